// Turn a runtime flag into a compile-time constant inside one instantiation, so the hot
// loop carries no branch for features that are off (softcap, ...).
#pragma once

#define JF_BOOL_SWITCH(COND, CONST_NAME, ...) \
  [&] {                                       \
    if (COND) {                               \
      constexpr static bool CONST_NAME = true; \
      return __VA_ARGS__();                   \
    } else {                                  \
      constexpr static bool CONST_NAME = false; \
      return __VA_ARGS__();                   \
    }                                         \
  }()

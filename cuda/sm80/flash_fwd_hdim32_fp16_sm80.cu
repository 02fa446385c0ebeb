// One instantiation per file (build parallelism, selectable subsets).
#include "launch_templates_sm80.h"

JF_SM80_INSTANTIATE_FWD(cutlass::half_t, 32)

from .bench import main
import sys
sys.exit(main())

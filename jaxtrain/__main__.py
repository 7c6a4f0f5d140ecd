import sys

from jaxtrain.cli import main

sys.exit(main())

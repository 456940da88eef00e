import sys

from pipeline_assets.trainer.train import main

sys.exit(main())

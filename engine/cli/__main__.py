"""`python -m engine.cli`: the llmops command."""

import sys

from engine.cli.main import main

sys.exit(main())

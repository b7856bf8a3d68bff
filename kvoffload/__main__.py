from kvoffload.cli import main

raise SystemExit(main())

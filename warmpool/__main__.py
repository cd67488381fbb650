from warmpool.cli import main

raise SystemExit(main())

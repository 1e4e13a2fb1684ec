from orchard.cli import main

raise SystemExit(main())

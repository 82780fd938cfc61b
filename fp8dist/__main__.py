from fp8dist.cli import main

raise SystemExit(main())

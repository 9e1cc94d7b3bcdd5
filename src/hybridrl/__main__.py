from hybridrl.cli import main

raise SystemExit(main())

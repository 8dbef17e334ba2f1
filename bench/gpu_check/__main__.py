from pdserve.bench.gpu_check.cli import main

raise SystemExit(main())

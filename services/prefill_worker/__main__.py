from services.prefill_worker.server import main

raise SystemExit(main())

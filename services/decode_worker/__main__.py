from services.decode_worker.server import main

raise SystemExit(main())

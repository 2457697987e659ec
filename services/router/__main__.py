"""``python -m services.router``: serve the OpenAI API in front of the workers (see ``--help``)."""

from __future__ import annotations

import logging
import sys

import uvicorn

from services.common import event_loop
from services.common.heap import freeze_startup_heap
from services.router.app import create_app
from services.router.settings import parse_settings
from shared.logs import configure_logging
from shared.models.config import ModelLoadError
from shared.tokenizer import TokenizerLoadError


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(argv)
    try:
        loop = event_loop.loop_name()
    except ValueError as e:
        print(f"router: {e}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    if not settings.decode_workers and not settings.redis_url:
        logging.getLogger("cleave.router").warning(
            "no --decode-worker or --redis-url given: every generation request will answer 503 until one is configured"
        )
    try:
        app = create_app(settings)
    except (ModelLoadError, TokenizerLoadError) as e:
        print(f"router: cannot load the model: {e}", file=sys.stderr)
        return 2
    freeze_startup_heap()  # the tokenizer, the app and their modules
    # The app logs one line per request itself; uvicorn's access log would duplicate it.
    # log_config=None: uvicorn's own lines go through the handler configured above (text or json).
    # httptools parses and frames HTTP in C where installed (uvicorn's "auto"); the loop as the workers'.
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False,
                log_config=None, loop=loop)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

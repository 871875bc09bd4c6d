"""``python -m tinker_server --config configs/tinker_tiny.yaml [key=value ...]``: serve the
Tinker API (docs/tinker.md) until interrupted."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tinker_server",
        description="Serve the Tinker API (the official tinker SDK and tinker-cookbook as clients) on Enginekit's engines.",
    )
    parser.add_argument("--config", default="configs/tinker_tiny.yaml", help="YAML config (default: configs/tinker_tiny.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value settings, e.g. server.model_root=/models server.port=8001")
    args = parser.parse_args(argv)
    from tinker_server.app import serve
    from tinker_server.config import load_server_config
    from tinker_server.factory import EngineFactory

    try:
        cfg = load_server_config(args.config, args.overrides)
        factory = EngineFactory(cfg.server.model_root, cfg.alias_table(), cfg.run_settings())
    except ValueError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None
    print(f"[enginekit] tinker server: serving {factory.served_models()} on http://{cfg.server.host}:{cfg.server.port}", flush=True)
    serve(cfg.server_settings(), factory)


if __name__ == "__main__":
    main()

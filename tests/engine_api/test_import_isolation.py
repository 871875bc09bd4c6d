"""`import engine_api` pulls in no backend, no megatron and no transformers."""

from __future__ import annotations

import json
import subprocess
import sys


def test_engine_api_imports_no_backend():
    code = "import sys, json, engine_api; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    modules = json.loads(out.strip().splitlines()[-1])
    heavy = [
        m
        for m in modules
        if m.split(".")[0] in {"megatron", "transformers", "backends", "roles", "recipes", "posttrain", "transformer_engine"}
    ]
    assert heavy == []
    assert "engine_api.base" in modules  # the check really ran the import

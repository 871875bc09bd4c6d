"""The on-policy distillation demo's teacher (``configs/distill_tiny.yaml``, ``trainer.setup``):
the tiny sorting model trained with SFT on the demo's prompts (2-3 digits), built on first use.

The demo's student is the RL demo's tiny model, randomly initialised; the teacher is the same
architecture after 300 SFT steps (``configs/sft_tiny.yaml``, about 20 s on one CPU core), which
sorts every held-out prompt (validation reward 1.0 at temperature 1). Nothing is downloaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEACHER_DIR = "outputs/distill_tiny_teacher"  # relative to the working directory, as the config's distill.teacher_path
SFT_STEPS = 300
# A launcher's variables would make the SFT process join the RL run's process group.
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "ROLE_RANK")


def build_teacher(out_dir: str = TEACHER_DIR, steps: int = SFT_STEPS, what: str = "the distillation demo's teacher") -> str:
    """``<out_dir>/hf``, trained now unless it is there (``config.json`` and weights).

    Raises:
        RuntimeError: the SFT run failed (its output's tail in the message).
    """
    hf = os.path.join(out_dir, "hf")
    if os.path.isfile(os.path.join(hf, "config.json")) and os.path.isfile(os.path.join(hf, "model.safetensors")):
        return hf
    cmd = [
        sys.executable, "-m", "recipes.sft", "--config", str(ROOT / "configs" / "sft_tiny.yaml"),
        "data.min_digits=2", "data.max_digits=3", f"trainer.total_steps={steps}", f"trainer.output_dir={out_dir}",
        "trainer.progress_bar=false", "trainer.log_samples_every=0", "trainer.loggers=[jsonl]",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    print(f"[enginekit] training {what} ({steps} SFT steps) into {hf}", flush=True)
    proc = subprocess.run(cmd, cwd=os.getcwd(), env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} (SFT into {out_dir}) failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return hf

"""TRL's GRPOTrainer on a local model, prompt file and reward file: the peer side of
``benchmarks.trl_grpo``. Runs in TRL's own environment (``.venv-trl``); imports TRL, transformers,
datasets and torch only, never Enginekit.

Run: ``.venv-trl/bin/python benchmarks/peers/trl_grpo.py --model DIR --prompts FILE.jsonl
--reward FILE.py:score --steps N [--prompts-per-step 8 --group 8 --max-new-tokens 8]``;
prints one JSON line with the steps run, the mean completion length over the logged steps and the
last logged metrics.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="jsonl rows with 'prompt' and the reward's columns")
    p.add_argument("--reward", required=True, help="FILE.py:function, called as function(prompt, response, **columns)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    path, name = a.reward.rsplit(":", 1)
    spec = importlib.util.spec_from_file_location("user_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    score = getattr(module, name)

    rows = [json.loads(line) for line in open(a.prompts)]
    columns = [k for k in rows[0] if k != "prompt"]
    data = Dataset.from_list([{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])

    def reward(prompts, completions, **kw):
        out = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            text = completion[0]["content"] if isinstance(completion, list) else completion
            out.append(float(score(prompt[-1]["content"], text, **{c: kw[c][i] for c in columns})))
        return out

    config = GRPOConfig(
        output_dir=a.out,
        max_steps=a.steps,
        per_device_train_batch_size=a.prompts_per_step * a.group,  # completions per optimizer step
        gradient_accumulation_steps=1,
        num_generations=a.group,
        max_completion_length=a.max_new_tokens,
        num_iterations=1,  # one update per generation batch: TRL reuses its log-probs
        beta=0.0,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        temperature=1.0,
        gradient_checkpointing=False,  # TRL 1.16's default is on; Enginekit's run does not checkpoint
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=a.seed,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "reward" in h]
    lengths = [h["completions/mean_length"] for h in logged if "completions/mean_length" in h]
    mean_length = sum(lengths) / len(lengths) if lengths else None
    print(json.dumps({"steps": trainer.state.global_step, "mean_completion_length": mean_length, "last": logged[-1] if logged else {}}))


if __name__ == "__main__":
    main()

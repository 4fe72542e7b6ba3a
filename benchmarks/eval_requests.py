"""How many forward passes and padded tokens lm-eval's six tasks cost at each request batch size.

    PYTHONPATH=src python benchmarks/eval_requests.py --tokenizer <SmolLM2 folder> --task-data-dir <cache>/zero-shot \\
        --batch-size 32 64 128 256 --out counts.json

No model runs: an lm-eval HFLM whose scoring records the tokenized requests instead, then lm-eval's
own Collator (sorted by length, one-token continuations of a context shared) cut into batches.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


def recorded_requests(tokenizer_dir: Path, task_data_dir: Path) -> list:
    """Every (request key, context tokens, continuation tokens) of the six tasks, as HFLM sees them."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from aqflow.data.zero_shot import ZERO_SHOT_TASKS, task_data_files
    from aqflow.evaluation import batched_scoring, zero_shot

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=8, max_position_embeddings=8192)
    model = LlamaForCausalLM(config).eval()
    seen: list = []

    def record(self, requests, disable_tqdm=False, override_bs=None):
        seen.extend(requests)
        return [(0.0, False)] * len(requests)

    original = batched_scoring.BatchedScoringLM._loglikelihood_tokens
    batched_scoring.BatchedScoringLM._loglikelihood_tokens = record
    try:
        with tempfile.TemporaryDirectory() as work:
            zero_shot.run_zero_shot(model, tokenizer, task_data_files(task_data_dir, ZERO_SHOT_TASKS), Path(work),
                                    batch_size=1, bootstrap_iters=0)
    finally:
        batched_scoring.BatchedScoringLM._loglikelihood_tokens = original
    return seen


def batch_counts(requests: list, batch_size: int) -> dict:
    """Forward passes, padded and real input tokens of lm-eval's batches at `batch_size`."""
    from lm_eval.models.utils import Collator

    reorder = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])), group_by="contexts",
                       group_fn=lambda r: r[-2] + r[-1][:-1])
    passes = padded = real = 0
    for chunk in reorder.get_batched(n=batch_size):
        lengths = [len(context) + len(continuation) - 1 for _, context, continuation in chunk]
        passes += 1
        padded += max(lengths) * len(lengths)
        real += sum(lengths)
    return {"forward_passes": passes, "padded_tokens": padded, "real_tokens": real}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--task-data-dir", type=Path, required=True)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    requests = recorded_requests(args.tokenizer, args.task_data_dir)
    result = {"requests": len(requests), "batches": {str(size): batch_counts(requests, size) for size in args.batch_size}}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

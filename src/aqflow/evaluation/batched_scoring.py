"""lm-eval's loglikelihood requests scored a batch at a time instead of a request at a time.

lm-eval's `HFLM._loglikelihood_tokens` (0.4.x) runs the model on a padded batch, takes the
log-softmax of every position of the batch, then, per request, copies its continuation tokens to
the GPU, takes an argmax and a gather and reads both back with two host synchronisations. With
the six zero-shot tasks' ~65k requests that per-request work, not the model, is most of an
evaluation on a GPU.

`BatchedScoringLM` keeps everything that fixes the numbers: lm-eval's own request order and
batches (its `Collator`, sorted by length, one-token continuations of a shared context scored
once), its inputs (left-truncated to the model's length, right-padded), the model call, the
log-softmax in lm-eval's dtype and its per-request sum in that dtype. Only the bookkeeping moves:
the inputs are built on the host and copied once a batch, the log-softmax is taken over the
continuation positions only (it is row-wise, so these rows are the same numbers), and every
request's sum and greedy match come back in one copy a batch.

Two more host costs go, measured on an H100 (benchmarks/eval_profile.py in the git history: of ~170 s for the six
tasks at 128 requests a batch, ~55 s were Jinja compiling the same few prompt templates once per
document and choice, ~25 s tokenizing one string at a time):
- `cached_templates()`: lm-eval's `apply_template` compiles each distinct template once (the
  rendering of a compiled template is the same text);
- `BatchedScoringLM.loglikelihood` tokenizes every string its requests need in one batched call
  of the fast tokenizer (the same ids as one `encode` a string) before lm-eval's own loop reads them,
  from its Rust backend where that is checked to give the tokenizer's own ids (`batch_input_ids`);
- `batch_layout` lays a batch out with array operations, not a Python step per token.
Measured on a 2-core CPU with the model work replaced by constants (benchmarks/eval_overhead.py in the git history
--host-only), the last two took the six tasks' host work from 12.6 to 10.2 s.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import Collator, _add_special_kwargs, has_bos_prefix
from tqdm.auto import tqdm

from aqflow.evaluation.logits_budget import (DEFAULT_LOGITS_BUDGET_BYTES, logits_shape_bytes, score_in_pieces,
                                             sequences_within_budget)


@dataclass(frozen=True)
class BatchLayout:
    """Where each scored token of a batch sits, for one gather over the model's logits.

    input_ids:   [batch, padded_len] int64, right-padded with 0 (lm-eval's padding)
    rows:        [num_rows, 2] int64, (batch index, position) of every distinct continuation
                 position: the logits row that predicts a continuation token
    token_rows:  [num_tokens] int64, index into `rows` of each scored token
    targets:     [num_tokens] int64, the continuation token scored there
    owners:      [num_tokens] int64, which request (0..num_requests-1) each scored token belongs to
    num_requests: requests answered by this batch (one-token cache hits included)
    """

    input_ids: torch.Tensor
    rows: torch.Tensor
    token_rows: torch.Tensor
    targets: torch.Tensor
    owners: torch.Tensor
    num_requests: int


def model_input(context: list[int], continuation: list[int], max_length: int) -> list[int]:
    """lm-eval's causal input: context + continuation, left-truncated to max_length + 1, last dropped."""
    return (context + continuation)[-(max_length + 1):][:-1]


def batch_layout(inputs: list[list[int]], scored: list[list[list[int]]]) -> BatchLayout:
    """Lay out one batch: inputs[i] is request i's model input; scored[i] lists the continuations
    answered from its logits (itself, plus one-token cache hits sharing its context), each scored
    on the last len(continuation) positions of the input, as lm-eval's slicing does. Built with
    array operations over the batch's tokens (a Python loop per token cost ~3 s of an H100
    evaluation's 65k requests)."""
    input_lengths = np.array([len(ids) for ids in inputs], dtype=np.int64)  # [batch]
    input_ids = np.zeros((len(inputs), int(input_lengths.max())), dtype=np.int64)
    input_ids[np.arange(input_ids.shape[1]) < input_lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(inputs), dtype=np.int64, count=int(input_lengths.sum()))  # right-padded with 0
    # the positions that predict each input's longest continuation; shorter ones use its last rows
    longest = np.array([max(len(cont) for cont in continuations) for continuations in scored], dtype=np.int64)
    first_row = np.cumsum(longest) - longest  # [batch]
    row_batch = np.repeat(np.arange(len(inputs)), longest)  # [num_rows]
    row_position = np.repeat(input_lengths - longest - first_row, longest) + np.arange(int(longest.sum()))
    # every continuation (request) in order, with the input it is answered from
    continuation_lengths = np.array([len(cont) for continuations in scored for cont in continuations], dtype=np.int64)
    continuation_input = np.repeat(np.arange(len(inputs)), [len(continuations) for continuations in scored])
    offsets = first_row[continuation_input] + longest[continuation_input] - continuation_lengths  # [num_requests]
    token_starts = np.cumsum(continuation_lengths) - continuation_lengths
    token_rows = np.repeat(offsets - token_starts, continuation_lengths) + np.arange(int(continuation_lengths.sum()))
    targets = np.fromiter(itertools.chain.from_iterable(cont for continuations in scored for cont in continuations),
                          dtype=np.int64, count=int(continuation_lengths.sum()))
    owners = np.repeat(np.arange(len(continuation_lengths)), continuation_lengths)
    rows = np.stack([row_batch, row_position], axis=1)
    return BatchLayout(*(torch.from_numpy(array) for array in (input_ids, rows, token_rows, targets, owners)),
                       len(continuation_lengths))


def score_batch(logits: torch.Tensor, layout: BatchLayout, softmax_dtype: torch.dtype | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-likelihood and greedy match of every request of a batch, on the logits' device.

    logits: [batch, padded_len, vocab] from the model on layout.input_ids (moved there).
    Returns (loglikelihood [num_requests] float64, is_greedy [num_requests] bool): each request's
    summed continuation log-probability, rounded to the log-softmax dtype as lm-eval's
    `logits.sum()` is, and whether every continuation token is the argmax at its position.
    """
    device = logits.device
    rows = layout.rows.to(device, non_blocking=True)
    log_probs = F.log_softmax(logits[rows[:, 0], rows[:, 1]], dim=-1, dtype=softmax_dtype)  # [num_rows, vocab]
    greedy = log_probs.argmax(dim=-1)  # [num_rows]
    token_rows = layout.token_rows.to(device, non_blocking=True)
    targets = layout.targets.to(device, non_blocking=True)
    owners = layout.owners.to(device, non_blocking=True)
    token_log_probs = log_probs[token_rows, targets]  # [num_tokens]
    # lm-eval sums each request's log-probs in their own dtype (a half sum accumulates in float32
    # and rounds once): the same here, per request, through a float32 segment sum.
    sums = torch.zeros(layout.num_requests, dtype=torch.float32, device=device)
    sums.index_add_(0, owners, token_log_probs.float())
    loglikelihood = sums.to(log_probs.dtype).double()
    mismatches = torch.zeros(layout.num_requests, dtype=torch.int32, device=device)
    mismatches.index_add_(0, owners, (greedy[token_rows] != targets).int())
    return loglikelihood, mismatches == 0


@contextlib.contextmanager
def cached_templates() -> Iterator[None]:
    """Inside: lm-eval's `utils.apply_template` compiles each distinct template string once, with
    lm-eval's own Jinja environment, instead of once per call."""
    from lm_eval import utils

    shipped = utils.apply_template
    compiled: dict[str, object] = {}

    def apply_template(template: str, doc: dict) -> str:
        if template not in compiled:
            compiled[template] = utils.env.from_string(template)
        return compiled[template].render(**doc)

    utils.apply_template = apply_template
    try:
        yield
    finally:
        utils.apply_template = shipped


def encode_pair_strings(context: str, continuation: str) -> list[tuple[str, bool | None]]:
    """The strings (and their add_special_tokens argument) lm-eval's causal `loglikelihood`
    tokenizes for one request: with a context, context + continuation and the context, after
    moving the context's trailing spaces to the continuation; without one, the continuation alone."""
    if context == "":
        return [(continuation, False)]
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    return [(context + continuation, None), (context, None)]


CHECKED_STRINGS = 64  # strings tokenized both ways before the backend alone is trusted with the rest


def batch_input_ids(tokenizer, strings: list[str], kwargs: dict) -> list[list[int]]:
    """`tokenizer(strings, **kwargs)["input_ids"]`, from the fast tokenizer's Rust backend directly
    where that gives the same ids: the tokenizer's own call converts every encoding to a Python
    dict of several fields (~2 s of an evaluation's 88k strings on an H100 box). The first
    CHECKED_STRINGS strings go through the tokenizer's own call too (which also sets the backend's
    truncation, padding and special-token state for the call), and any difference, any argument
    besides add_special_tokens or a backend with truncation or padding on keeps the own call."""
    sample = tokenizer(strings[:CHECKED_STRINGS], **kwargs)["input_ids"] if strings else []
    if len(strings) <= CHECKED_STRINGS:
        return sample
    backend = getattr(tokenizer, "_tokenizer", None)
    usable = (hasattr(backend, "encode_batch") and not set(kwargs) - {"add_special_tokens"}
              and getattr(backend, "truncation", None) is None and getattr(backend, "padding", None) is None)
    if usable:
        direct = [encoding.ids for encoding in
                  backend.encode_batch(strings, add_special_tokens=kwargs.get("add_special_tokens", True))]
        if direct[:CHECKED_STRINGS] == [list(ids) for ids in sample]:
            return direct
    return sample + tokenizer(strings[CHECKED_STRINGS:], **kwargs)["input_ids"]


class BatchedScoringLM(HFLM):
    """lm-eval's HFLM with `_loglikelihood_tokens` scored a batch at a time (see the module doc);
    causal models only, fixed batch size. Its strings are tokenized in one batch first."""

    _encoded: dict | None = None
    logits_budget_bytes: int | None = DEFAULT_LOGITS_BUDGET_BYTES  # the most logits one forward pass holds
    _piece_cap: int | None = None  # the most sequences a pass held once the card ran out of memory

    def _special_tokens_kwargs(self, string: str, add_special_tokens: bool | None, bos_string: str) -> dict:
        """tok_encode's arguments to the tokenizer for `string` (HFLM.tok_encode's rule)."""
        kwargs = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, bos_string):
            kwargs["add_special_tokens"] = False
        return kwargs

    def prefetch_encodings(self, pairs: list[tuple[str, str]]) -> None:
        """Tokenize every string the requests' (context, continuation) pairs need, grouped by
        tokenizer arguments, one batched call per group; tok_encode then reads them."""
        bos_string = self.tokenizer.decode(self.prefix_token_id)
        groups: dict[tuple, list[tuple[str, bool | None]]] = {}
        for context, continuation in pairs:
            for string, add_special in encode_pair_strings(context, continuation):
                kwargs = self._special_tokens_kwargs(string, add_special, bos_string)
                groups.setdefault(tuple(sorted(kwargs.items())), []).append((string, add_special))
        encoded = {}
        for kwargs, keys in groups.items():
            unique = list(dict.fromkeys(keys))
            encoded.update(zip(unique, batch_input_ids(self.tokenizer, [string for string, _ in unique], dict(kwargs))))
        self._encoded = encoded

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        if self._encoded is not None and not kwargs and (string, add_special_tokens) in self._encoded:
            encoding = list(self._encoded[(string, add_special_tokens)])
            return encoding[-left_truncate_len:] if left_truncate_len else encoding
        return super().tok_encode(string, add_special_tokens=add_special_tokens, left_truncate_len=left_truncate_len,
                                  **kwargs)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        if self.backend != "causal":
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        self.prefetch_encodings([request.args for request in requests])
        try:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        finally:
            self._encoded = None

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        if self.backend != "causal":
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        # lm-eval's own ordering and one-token-continuation grouping (HFLM._loglikelihood_tokens)
        reorder = Collator(
            requests,
            sort_fn=lambda request: (-len(request[1] + request[2]), tuple(request[1] + request[2])),
            group_by="contexts" if self.logits_cache else None,
            group_fn=lambda request: request[-2] + request[-1][:-1],
        )
        batch_size = override_bs or (self.batch_size if self.batch_size != "auto" else 1)
        placeholder = torch.empty(1, 1, 1)
        results: list[tuple[float, bool]] = []
        progress = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                        desc="Running loglikelihood requests (batched)")
        vocab, bytes_per_logit = logits_shape_bytes(self.model)
        for chunk in reorder.get_batched(n=int(batch_size)):
            inputs, scored, answered_strings = [], [], []
            for request_string, context, continuation in chunk:
                if not context or not continuation or len(continuation) > self.max_length:
                    raise ValueError(f"lm-eval request {request_string!r}: empty context or continuation, or a "
                                     f"continuation longer than the model's {self.max_length} tokens")
                inputs.append(model_input(context, continuation, self.max_length))
                # the requests answered by this one's logits, in the order lm-eval records them
                answered = list(reorder.get_cache(req_str=request_string, cxt_toks=context,
                                                  cont_toks=continuation, logits=placeholder))
                scored.append([list(cont) for _, cont, _ in answered])
                answered_strings.append([string for string, _, _ in answered])
            # a batch whose logits would pass the budget goes through the model in pieces (a
            # request's numbers do not depend on the batch it is scored in)
            piece = min(sequences_within_budget(len(inputs), max(map(len, inputs)), vocab, bytes_per_logit,
                                                self.logits_budget_bytes), self._piece_cap or len(inputs))

            def score(start: int, stop: int) -> list[tuple[float, bool]]:
                return self._score(inputs[start:stop], scored[start:stop])

            answers, held = score_in_pieces(score, len(inputs), piece)
            if held < piece:  # the card ran out at `piece`: later batches start from what held
                self._piece_cap = held
            for answer, request_string in zip(answers, itertools.chain.from_iterable(answered_strings)):
                results.append(answer)
                if request_string is not None:  # loglikelihood_rolling's requests carry None
                    self.cache_hook.add_partial("loglikelihood", request_string, answer)
            progress.update(len(answers))
        progress.close()
        return reorder.get_original(results)

    def _score(self, inputs: list[list[int]], scored: list[list[list[int]]]) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy match) of every request answered by one forward pass over `inputs`."""
        layout = batch_layout(inputs, scored)
        input_ids = layout.input_ids.pin_memory() if self.device.type == "cuda" else layout.input_ids
        logits = self._model_call(input_ids.to(self.device, non_blocking=True))
        loglikelihood, is_greedy = score_batch(logits, layout, self.softmax_dtype)
        return list(zip(loglikelihood.tolist(), is_greedy.tolist()))

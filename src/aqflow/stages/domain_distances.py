"""`python -m aqflow domain-distances`: how far each evaluation domain is from the calibration text.

Reads the calibration-role documents of the calibration corpus and the evaluation-role documents of
each evaluation corpus (fetch-data's Parquet files; the domain is the file's name, as in eval.json),
counts their tokens under the model's tokenizer and writes, into --output (JSON), the
Jensen-Shannon divergence of each domain's unigram distribution from the calibration text's, with
its sd over subsampling draws (`aqflow.data.domain_distance` says why this measure and why the
subsampling), the domains ordered from the nearest to the farthest. paper-tables orders its domain
table by it and measures the domain-distance claim against it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from aqflow.stagekit import stage_cli
from aqflow.io.artifacts import verify_inputs, write_json
from aqflow.data.domain_distance import near_to_far, sampled_distance, text_token_counts
from aqflow.data.offline_text import CALIBRATION, EVALUATION, CorpusError, load_split_corpus, role_texts
from aqflow.models.fetch import ModelInputError, load_tokenizer
from aqflow.stagekit.stage_cli import option
from aqflow.stagekit.stage_errors import EXPECTED_ERRORS, StageInputError

STAGE = "domain-distances"
INPUT_ERRORS = (*EXPECTED_ERRORS, CorpusError, ModelInputError)
MEASURE = ("Jensen-Shannon divergence (nats, 0 to ln 2) between token unigram distributions of the calibration "
           "text and of the domain's evaluation text, under the model's tokenizer; the evaluation side subsampled "
           "to sample_tokens tokens, mean and sd over the draws")


@dataclass(frozen=True)
class DomainDistancesSettings:
    max_tokens: int = field(default=1_000_000, metadata=option(
        "tokens read from each text at most (documents in a seeded random order; the last one cut)"))
    sample_tokens: int = field(default=0, metadata=option(
        "tokens of every domain's evaluation text each draw compares (0: the smallest domain's count)"))
    draws: int = field(default=16, metadata=option("subsampling draws per domain"))
    seed: int = field(default=0, metadata=option("seed of the document order and of the draws"))
    quiet: bool = field(default=False, metadata=option("no progress bar"))

    def __post_init__(self):
        if self.max_tokens < 1 or self.sample_tokens < 0 or self.draws < 1:
            raise ValueError(f"need max_tokens >= 1, sample_tokens >= 0 and draws >= 1; got {self.max_tokens}, "
                             f"{self.sample_tokens}, {self.draws}")


@dataclass(frozen=True)
class DomainDistancesPaths:
    model_dir: Path = field(metadata=option("model folder (its tokenizer is used)"))
    calibration: Path = field(metadata=option("the calibration corpus .parquet (from fetch-data): its calibration documents"))
    corpora: tuple[Path, ...] = field(metadata=option(
        "evaluation corpora .parquet (from fetch-data): their evaluation documents; the domain is the file's name",
        positional=True, nargs="+"))
    output: Path = field(metadata=option("domains .json to write"))


def _counter(tokenizer, vocab_size: int, settings: DomainDistancesSettings):
    from tqdm.auto import tqdm

    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]

    def count(texts: list[str], label: str):
        with tqdm(total=len(texts), desc=label, unit="doc", disable=settings.quiet) as bar:
            return text_token_counts(texts, encode, vocab_size, settings.max_tokens, settings.seed, bar.update)

    return count


def run(settings: DomainDistancesSettings, paths: DomainDistancesPaths) -> dict:
    """The distances of every evaluation corpus, written to paths.output; the record written."""
    names = [path.stem for path in paths.corpora]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise StageInputError(f"evaluation corpora named twice: {repeated}")
    verify_inputs(paths.model_dir, paths.calibration, *paths.corpora)
    tokenizer = load_tokenizer(paths.model_dir)
    # ids of added tokens may lie beyond vocab_size: count over the largest id the tokenizer knows
    vocab_size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
    count = _counter(tokenizer, vocab_size, settings)
    _, texts = role_texts(load_split_corpus(paths.calibration), CALIBRATION)
    calibration, calibration_tokens, calibration_documents = count(texts, f"{paths.calibration.stem} calibration")
    counted = {}
    for name, path in zip(names, paths.corpora):
        _, texts = role_texts(load_split_corpus(path), EVALUATION)
        counted[name] = count(texts, f"{name} evaluation")
    empty = sorted(name for name, (_, tokens, _) in counted.items() if tokens == 0)
    if calibration_tokens == 0 or empty:
        raise StageInputError(f"texts without a single token: {empty or [paths.calibration.stem + ' calibration']}")
    sample_tokens = settings.sample_tokens or min(tokens for _, tokens, _ in counted.values())
    short = sorted(name for name, (_, tokens, _) in counted.items() if tokens < sample_tokens)
    if short:
        raise StageInputError(f"--sample-tokens {sample_tokens}: the evaluation text of {short} has fewer tokens")
    distances = {name: sampled_distance(calibration, counts, sample_tokens, settings.draws, settings.seed)
                 for name, (counts, _, _) in counted.items()}
    record = {
        "measure": MEASURE,
        "tokenizer": str(paths.model_dir),
        "calibration": {"corpus": paths.calibration.stem, "path": str(paths.calibration), "role": CALIBRATION,
                        "tokens": calibration_tokens, "documents": calibration_documents},
        "settings": {**{key: value for key, value in asdict(settings).items() if key != "quiet"},
                     "sample_tokens": sample_tokens},
        "domains": [{"domain": name, "distance": distances[name].mean, "distance_sd": distances[name].sd,
                     "tokens": counted[name][1], "documents": counted[name][2], "corpus": str(path)}
                    for name in near_to_far(distances) for path in [paths.corpora[names.index(name)]]],
    }
    write_json(paths.output, record)
    return record


def summary(record: dict) -> str:
    rows = [f"  {row['domain']:<28} {row['distance']:.4f} ± {row['distance_sd']:.4f}" for row in record["domains"]]
    return (f"JS divergence from {record['calibration']['corpus']} calibration text "
            f"({record['settings']['sample_tokens']} tokens per draw), nearest first:\n" + "\n".join(rows))


build_parser, main = stage_cli.entry_points(STAGE, __doc__, run, INPUT_ERRORS, summary)

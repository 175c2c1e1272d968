"""Zero-shot multiple-choice tasks, scored as lm-evaluation-harness (v0.4 task yamls) scores them.

Every document turns into one log-likelihood request `(context, continuation)` per choice; the
prediction is the choice with the highest summed continuation log-likelihood (`acc`), or the
highest log-likelihood divided by the choice's length in characters (`acc_norm`: lm-eval's
`len(choice)` on the choice string *without* the leading space). Ties go to the first choice
(`np.argmax`). No few-shot examples, no description, no BOS token: lm-eval's HF model as it was until it
followed the tokenizer's default (which adds BOS for Llama and Mistral tokenizers, not SmolLM2's): for those
models current lm-eval's numbers differ by that token. Every metric comes with lm-eval's standard error.
Log-probabilities are taken in float32 (lm-eval's `log_softmax` and its sum run in the model's dtype, bf16 or
fp16 on a GPU): a deliberate difference, which can flip only a near-tie between two choices.

Formats replicated (`{x}` = a field of the shared file; data files are in `shared/data`):

| task | data file | context | continuation per choice | metrics |
|---|---|---|---|---|
| piqa | piqa/valid.jsonl (+ valid-labels.lst) | `Question: {goal}\\nAnswer:` | `" {sol1}"`, `" {sol2}"` | acc, acc_norm |
| arc_easy, arc_challenge | arc/ARC-{Easy,Challenge}-Test.jsonl | `Question: {question.stem}\\nAnswer:` | `" {choice.text}"` | acc, acc_norm |
| boolq | boolq/val.jsonl (SuperGLUE) | `{passage}\\nQuestion: {question}?\\nAnswer:` | `" no"`, `" yes"` | acc |
| openbookqa | openbookqa/openbook_qa_test_llmfoundry.jsonl | `{query}` (= question_stem) | `" {choice}"` | acc, acc_norm |
| hellaswag | hellaswag/hellaswag_val_full.txt | `preprocess("{activity_label}: {ctx_a} {ctx_b.capitalize()}")` | `" " + preprocess(ending)` | acc, acc_norm |
| winogrande | winogrande/winogrande_dev_llmfoundry.jsonl | `{sentence before _}{option}`, one per option | `" {sentence after _, stripped}"` | acc |

Notes on the shared copies (the README there says where each comes from):
- OpenBookQA: the MosaicML jsonl's `query`/`choices`/`gold` equal the original test.tsv's
  Question Stem / choice texts / Answer Key for all 500 rows (checked when this was written).
- WinoGrande: lm-eval's partial scoring. The MosaicML file already holds lm-eval's two filled
  contexts (`context_options`) and the text after the blank (`continuation`); the score compares
  the log-likelihood of the same continuation after each filled context.
- HellaSwag: the shared file holds `preprocess(activity_label + ": " + ctx)` per task, but two
  details differ from lm-eval and are restored here. (1) lm-eval capitalizes `ctx_b`, the
  unfinished noun phrase that ends ActivityNet contexts ("... on a roof. he" -> "... on a roof. He");
  the file has the raw lower-case `ctx`, so a lower-case phrase after the last sentence end is
  `.capitalize()`d (3,236 of 10,042 contexts; every such phrase in the file is lower case, and
  WikiHow contexts end with a full sentence, so this is exactly lm-eval's rewrite unless a `ctx_b`
  itself contains a sentence end). (2) 18 lines still carry `[...]` spans (a URL, "[insert name]") that
  lm-eval's `preprocess` removes, so `preprocess` is applied again to those lines only (elsewhere a second
  pass would collapse a double space that lm-eval's single `replace("  ", " ")` keeps).
  (3) Not restorable from this file: lm-eval's `preprocess` strips *before* it removes the markers, so a
  WikiHow ending that starts with one ("[substeps] Include ...", "[step] ...", "[title] ...", common in
  the original) keeps a leading space there: choice `" Include ..."`, continuation `"  Include ..."`, one
  more character for acc_norm. The file's extraction (klosax's extract_hellaswag.cpp) stripped that space
  and which endings had it is lost, so here such an ending is scored as `" Include ..."`. lm-eval's exact
  HellaSwag numbers need the original hellaswag_val.jsonl (its sha256 is in the data README); the gap on
  this file is unknown (ActivityNet contexts, the first 3,243 tasks, are not affected).
"""

import math
import re
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from nibble.config import check_count
from nibble.eval import ALL_TASKS
from nibble.eval.data import DataFormatError, data_file, parsing, read_jsonl
from nibble.eval.perplexity import check_logits_fit, context_length, encode, eval_mode, model_device, model_logits


class Doc(NamedTuple):
    requests: list[tuple[str, str]]  # (context, continuation), one per choice
    choices: list[str]  # lm-eval's doc_to_choice; acc_norm divides by len(choice)
    gold: int


def _multiple_choice(context: str, choices: list[str], gold: int) -> Doc:
    # lm-eval's default target_delimiter " " joins context and choice.
    return Doc([(context, " " + c) for c in choices], choices, gold)


# Each task's data files under the data folder (data.py), named once for its loader and its errors.
FILES = {
    "piqa": ("piqa/valid.jsonl", "piqa/valid-labels.lst"),
    "hellaswag": ("hellaswag/hellaswag_val_full.txt",),
    "winogrande": ("winogrande/winogrande_dev_llmfoundry.jsonl",),
    "arc_easy": ("arc/ARC-Easy-Test.jsonl",),
    "arc_challenge": ("arc/ARC-Challenge-Test.jsonl",),
    "boolq": ("boolq/val.jsonl",),
    "openbookqa": ("openbookqa/openbook_qa_test_llmfoundry.jsonl",),
}


def task_files(tasks) -> list[str]:
    """The data files ``tasks`` read (`nibble.eval.data.require_data` checks them before a model loads)."""
    return [f for t in check_tasks(tasks) for f in FILES[t]]


def _jsonl(relpath: str) -> list[dict]:
    return read_jsonl(data_file(relpath))


def load_piqa() -> list[Doc]:
    docs = _jsonl(FILES["piqa"][0])
    labels = data_file(FILES["piqa"][1]).read_text().split()
    if len(labels) != len(docs):
        raise ValueError(f"piqa: {len(docs)} questions but {len(labels)} labels; the two files must align.")
    return [
        _multiple_choice(f"Question: {d['goal']}\nAnswer:", [d["sol1"], d["sol2"]], int(y))
        for d, y in zip(docs, labels)
    ]


def _load_arc(relpath: str) -> list[Doc]:
    out = []
    for d in _jsonl(relpath):
        q = d["question"]
        labels = [c["label"] for c in q["choices"]]  # "A".."E", or "1".."5" for a few questions
        out.append(
            _multiple_choice(
                f"Question: {q['stem']}\nAnswer:", [c["text"] for c in q["choices"]], labels.index(d["answerKey"])
            )
        )
    return out


def load_arc_easy() -> list[Doc]:
    return _load_arc(FILES["arc_easy"][0])


def load_arc_challenge() -> list[Doc]:
    return _load_arc(FILES["arc_challenge"][0])


def load_boolq() -> list[Doc]:
    gold = {"false": 0, "true": 1}
    return [
        _multiple_choice(f"{d['passage']}\nQuestion: {d['question']}?\nAnswer:", ["no", "yes"], gold[d["label"]])
        for d in _jsonl(FILES["boolq"][0])
    ]


def load_openbookqa() -> list[Doc]:
    return [
        _multiple_choice(d["query"], d["choices"], d["gold"])
        for d in _jsonl(FILES["openbookqa"][0])
    ]


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's hellaswag `preprocess`: WikiHow markup out, spacing tidied."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


# The unfinished lower-case phrase after the last sentence end: lm-eval's `ctx_b`.
_OPEN_PHRASE = re.compile(r"(?<=[.!?] )[a-z][^.!?]*$")


def load_hellaswag() -> list[Doc]:
    lines = data_file(FILES["hellaswag"][0]).read_text(encoding="utf-8").split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    if len(lines) % 6:  # a file cut mid-task lost its last one without a word
        raise ValueError(f"{len(lines)} lines, not whole tasks of 6 (context, gold, 4 endings)")
    out = []
    # 6 lines per task: context, gold index, 4 endings
    for i in range(0, len(lines) - 5, 6):
        context = _OPEN_PHRASE.sub(lambda m: m.group(0).capitalize(), lines[i])
        endings = [_bracket_leftovers(e) for e in lines[i + 2 : i + 6]]
        out.append(_multiple_choice(_bracket_leftovers(context), endings, int(lines[i + 1])))
    return out


def _bracket_leftovers(line: str) -> str:
    """lm-eval's `preprocess` for a line of the shared file that still holds a `[...]` span: the file's own
    cleanup removed only the WikiHow markers it knew. A line without one is as lm-eval's would be: a second
    pass there would collapse a double space that lm-eval's single `replace("  ", " ")` keeps (task 4121)."""
    return hellaswag_preprocess(line) if "[" in line else line


def load_winogrande() -> list[Doc]:
    out = []
    for d in _jsonl(FILES["winogrande"][0]):
        contexts = d["context_options"]
        out.append(Doc([(c, " " + d["continuation"]) for c in contexts], contexts, d["gold"]))
    return out


class Task(NamedTuple):
    load: Callable[[], list[Doc]]
    has_acc_norm: bool


# each of `nibble.eval.ALL_TASKS` (named there, for the command line without torch), in its order
TASKS = {
    "piqa": Task(load_piqa, True),
    "hellaswag": Task(load_hellaswag, True),
    "winogrande": Task(load_winogrande, False),
    "arc_easy": Task(load_arc_easy, True),
    "arc_challenge": Task(load_arc_challenge, True),
    "boolq": Task(load_boolq, False),
    "openbookqa": Task(load_openbookqa, True),
}


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation tokens, split the way lm-eval's `_encode_pair` splits them.

    Trailing whitespace of the context moves into the continuation, the two are encoded as one
    string, and the continuation is whatever follows the context's own encoding. So merges across
    the boundary (" yes" as one token) are the tokenizer's, not an artefact of encoding apart.
    """
    if context == "":
        # lm-eval scores a context-free continuation after a BOS (or EOS) token
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        return [prefix], encode(tokenizer, continuation, add_special_tokens=False)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = encode(tokenizer, context + continuation, add_special_tokens=False)
    context_ids = encode(tokenizer, context, add_special_tokens=False)
    return context_ids, whole[len(context_ids) :]


def loglikelihood(model, tokenizer, requests, batch_size=16, progress=True, desc="loglikelihood") -> list[float]:
    """Summed log-probability of each continuation given its context, for (context, continuation) pairs.

    Inputs longer than the model's context lose tokens on the left, as in lm-eval. Requests whose
    model inputs are identical (e.g. BoolQ's one-token " no" / " yes") share one forward pass.
    """
    check_count("batch_size", batch_size)  # inputs per forward pass
    max_len = context_length(model)
    inputs: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}  # input ids -> (request index, targets)
    for i, (context, continuation) in enumerate(requests):
        context_ids, cont_ids = encode_pair(tokenizer, context, continuation)
        if not cont_ids:
            raise ValueError(f"Request {i} has an empty continuation after tokenization: {continuation!r}")
        if not context_ids:
            raise ValueError(f"Request {i}: the context {context!r} encodes to no tokens; give a non-blank context.")
        full = context_ids + cont_ids
        if max_len is not None:
            if len(cont_ids) > max_len:
                raise ValueError(f"Request {i}: the continuation alone exceeds the model's context ({max_len}).")
            full = full[-(max_len + 1) :]
        inputs.setdefault(tuple(full[:-1]), []).append((i, cont_ids))

    # Longest first: padding stays small within a batch, and an out-of-memory shows up at once.
    order = sorted(inputs, key=len, reverse=True)
    device = model_device(model)
    if order:  # the first batch holds the longest inputs: refused before it, where its logits exceed the memory
        check_logits_fit(model, min(batch_size, len(order)), len(order[0]), batch_size, device, "inputs",
                         "one input's logits alone exceed it: run where there is more memory")
    scores = [0.0] * len(requests)
    with eval_mode(model), tqdm(total=len(requests), desc=desc, unit="req", disable=not progress) as bar:
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            # Right padding needs no attention mask: with causal attention, real tokens never see
            # the pads after them, and their positions are unchanged.
            ids = torch.zeros(len(batch), len(batch[0]), dtype=torch.long)
            for row, inp in enumerate(batch):
                ids[row, : len(inp)] = torch.tensor(inp)
            logits = model_logits(model, ids.to(device))
            for row, inp in enumerate(batch):
                for i, cont_ids in inputs[inp]:
                    # positions len(inp)-k .. len(inp)-1 predict the k continuation tokens
                    logprobs = F.log_softmax(logits[row, len(inp) - len(cont_ids) : len(inp)].float(), dim=-1)
                    target = torch.tensor(cont_ids, device=logprobs.device)
                    scores[i] = logprobs.gather(-1, target[:, None]).sum().item()
                bar.update(len(inputs[inp]))
    return scores


def _check_golds(docs: list[Doc], files: str) -> None:
    """A gold that is no index of its choices (a 1-based label, a letter) could never be hit: it scored as a miss
    without a word (WinoGrande with 1/2 labels: acc 0.30 for 0.55). lm-eval checks it too."""
    for i, doc in enumerate(docs):
        if not (isinstance(doc.gold, int) and not isinstance(doc.gold, bool) and 0 <= doc.gold < len(doc.choices)):
            raise DataFormatError(f"{files}: document {i} has the gold answer {doc.gold!r}, not the index of one of "
                                  f"its {len(doc.choices)} choices (0 to {len(doc.choices) - 1}); copy the file "
                                  "again from the shared data folder")


def score_docs(docs: list[Doc], lls: list[float], has_acc_norm: bool) -> dict:
    """acc (and acc_norm) over `docs`, given the log-likelihood of every request in order, each with its standard
    error as lm-eval gives it (the sample standard deviation of the hits over sqrt(n); NaN for one document)."""
    hits, hits_norm = [], []
    pos = 0
    for doc in docs:
        doc_lls = np.array(lls[pos : pos + len(doc.requests)])
        pos += len(doc.requests)
        # a NaN log-likelihood (a model whose outputs are not finite) scores NaN: np.argmax took the first NaN,
        # a guess that read as an accuracy (0.5 on BoolQ)
        unscored = np.isnan(doc_lls).any()
        hits.append(np.nan if unscored else int(np.argmax(doc_lls)) == doc.gold)
        if has_acc_norm:
            lengths = np.array([len(c) for c in doc.choices], dtype=np.float64)
            hits_norm.append(np.nan if unscored else int(np.argmax(doc_lls / lengths)) == doc.gold)
    result = {"acc": float(np.mean(hits)), "acc_stderr": _stderr(hits)}
    if has_acc_norm:
        result["acc_norm"], result["acc_norm_stderr"] = float(np.mean(hits_norm)), _stderr(hits_norm)
    result["n"] = len(docs)
    return result


def _stderr(hits: list[bool]) -> float:
    """lm-eval's `mean_stderr`: sqrt(sample variance / n). NaN for one document, whose spread cannot be estimated
    (lm-eval's "N/A"): 0.0 there read as an exact score, "1.0000 ± 0.0000"."""
    n = len(hits)
    return float(np.std(hits, ddof=1) / np.sqrt(n)) if n > 1 else math.nan


def check_tasks(tasks) -> list[str]:
    """``tasks`` (one name or several) as a list of known task names, else a ValueError naming the choices."""
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"Unknown task(s) {unknown}; choose from {list(ALL_TASKS)}.")
    if not tasks:
        raise ValueError(f"No tasks given; choose from {list(ALL_TASKS)}.")
    return tasks


def evaluate_tasks(model, tokenizer, tasks=ALL_TASKS, limit=None, batch_size=16, progress=True) -> dict:
    """Zero-shot accuracy per task: {task: {acc, acc_stderr, acc_norm?, acc_norm_stderr?, n}, "average": {acc}}.

    `limit` keeps the first `limit` documents of each task (as lm-eval's --limit). "average" is the
    unweighted mean of `acc` over the tasks run.
    """
    tasks = check_tasks(tasks)
    if limit is not None:  # no document would score NaN (not even JSON); a float was blamed on the data file
        check_count("limit", limit)
    results = {}
    for name in tasks:
        task = TASKS[name]
        files = " and ".join(str(data_file(f)) for f in FILES[name])
        with parsing(files):
            docs = task.load()[:limit]
        if not docs:
            raise DataFormatError(f"{files}: no {name} document in it; copy the file again from the shared data folder")
        _check_golds(docs, files)
        requests = [r for doc in docs for r in doc.requests]
        lls = loglikelihood(model, tokenizer, requests, batch_size=batch_size, progress=progress, desc=name)
        results[name] = score_docs(docs, lls, task.has_acc_norm)
    results["average"] = {"acc": float(np.mean([results[t]["acc"] for t in tasks]))}
    return results

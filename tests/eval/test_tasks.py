import math

import pytest
import torch
from torch import nn

from conftest import tiny_model
from nibble.eval import ALL_TASKS, data
from nibble.eval.data import DataFormatError
from nibble.eval.tasks import (
    FILES,
    TASKS,
    Doc,
    Task,
    encode_pair,
    evaluate_tasks,
    hellaswag_preprocess,
    load_arc_challenge,
    load_arc_easy,
    load_boolq,
    load_hellaswag,
    load_openbookqa,
    load_piqa,
    load_winogrande,
    loglikelihood,
    score_docs,
    task_files,
)


class ByteTokenizer:
    """One token per UTF-8 byte, so a continuation's tokens are its bytes."""

    bos_token_id = eos_token_id = 0

    def encode(self, text, add_special_tokens=True):
        return list(text.encode("utf-8"))


class BigramLM(nn.Module):
    """Logits of the next byte depend only on the current byte: log-likelihoods are set by hand."""

    def __init__(self, boost=()):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(256, 256))  # all zeros: every byte has log-prob -log(256)
        with torch.no_grad():
            for prev, nxt, value in boost:
                self.table[ord(prev), ord(nxt)] = value

    def forward(self, input_ids):
        return self.table[input_ids]


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A small GPT-2-style byte-level BPE: spaces attach to the following word (" yes" -> "Ġyes")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [d.requests[0][0] + d.requests[0][1] for d in load_piqa()[:300] + load_boolq()[:50]]
    corpus += ["Answer: yes", "Answer: no"] * 50
    trainer = trainers.BpeTrainer(
        vocab_size=256 + 300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


# --- the request strings are lm-eval's (hand-checked against the data files) ---


def test_piqa_requests():
    docs = load_piqa()
    assert len(docs) == 1838
    q = "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    sol = (" Provide the guinea pig with a cage full of a few inches of bedding made of ripped {}, "
           "you will also need to supply it with a water bottle and a food dish.")
    assert docs[0] == Doc([(q, sol.format("paper strips")), (q, sol.format("jeans material"))],
                          [sol.format("paper strips")[1:], sol.format("jeans material")[1:]], 0)
    assert docs[1].requests == [("Question: dresser\nAnswer:", " replace drawer with bobby pin "),
                                ("Question: dresser\nAnswer:", " finish, woodgrain with  bobby pin ")]
    assert docs[1].gold == 1


def test_arc_requests_including_numeric_answer_keys():
    easy = load_arc_easy()
    assert len(easy) == 2376 and len(load_arc_challenge()) == 1172
    q = "Question: Which piece of safety equipment is used to keep mold spores from entering the respiratory system?\nAnswer:"
    assert easy[1].requests == [(q, " safety goggles"), (q, " breathing mask"), (q, " rubber gloves"), (q, " lead apron")]
    assert easy[1].gold == 1  # answerKey "B"
    q = "Question: All living and nonliving material is composed of\nAnswer:"
    choices = ["air", "elements", "water", "soil"]
    assert easy[14] == Doc([(q, " " + c) for c in choices], choices, 1)  # labels "1".."4", answerKey "2"
    assert load_arc_challenge()[0].gold == 2  # answerKey "C"


def test_arc_questions_of_three_or_five_choices_keep_them_all_and_the_gold_among_them():
    """A few ARC questions have 3 or 5 choices (answerKey "E": gold 4; "2" of labels "1".."3": gold 1)."""
    easy, challenge = load_arc_easy(), load_arc_challenge()
    assert len(easy[1441].choices) == 5 and easy[1441].gold == 4  # answerKey "E"
    assert easy[1441].requests[4][1] == " " + easy[1441].choices[4]
    assert len(challenge[385].choices) == 3 and challenge[385].gold == 1  # labels "1".."3", answerKey "2"
    assert len(easy[93].choices) == 3 and easy[93].gold == 1  # labels "A".."C", answerKey "B"


def test_boolq_requests():
    docs = load_boolq()
    assert len(docs) == 3270
    context = (
        "Phantom pain -- Phantom pain sensations are described as perceptions that an individual experiences "
        "relating to a limb or an organ that is not physically part of the body. Limb loss is a result of either "
        "removal by amputation or congenital limb deficiency. However, phantom limb sensations can also occur "
        "following nerve avulsion or spinal cord injury.\n"
        "Question: is pain experienced in a missing body part or paralyzed area?\nAnswer:"
    )
    assert docs[2] == Doc([(context, " no"), (context, " yes")], ["no", "yes"], 1)  # label "true"
    assert docs[0].gold == 0  # label "false"


def test_openbookqa_requests():
    docs = load_openbookqa()
    assert len(docs) == 500
    assert docs[2] == Doc([("Predators eat", " lions"), ("Predators eat", " humans"), ("Predators eat", " bunnies"),
                           ("Predators eat", " grass")], ["lions", "humans", "bunnies", "grass"], 2)


def test_hellaswag_requests_capitalize_ctx_b_and_apply_lm_eval_preprocess():
    docs = load_hellaswag()
    assert len(docs) == 10042
    ctx = "Roof shingle removal: A man is sitting on a roof. He"  # the file has "... roof. he"
    endings = ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.", "is holding a rubik's cube.",
               "starts pulling up roofing on a roof."]
    assert docs[0] == Doc([(ctx, " " + e) for e in endings], endings, 3)
    assert docs[1].requests[0][0] == "Clean and jerk: A lady walks to a barbell. She bends down and grabs the pole. The lady"
    # WikiHow contexts end with a full sentence and are left as they are
    assert docs[3243].requests[0][0].startswith("Personal Care and Style: How to become a fashion consultant. Obtain")
    assert docs[3243].requests[0][0].endswith("familiarize yourself with foundational concepts in fashion.")
    # "[www.kiddio.org]" is still in the shared file; lm-eval's preprocess drops it
    assert "Visit a site like to find loads of creative activities" in docs[3505].requests[0][0]
    assert hellaswag_preprocess("Label: [header] How to x [title] Do y. [step] Then  z ") == "Label: How to x. Do y. Then z"


def test_hellaswag_capitalizes_only_the_open_phrase_after_the_last_sentence_end(tmp_path, monkeypatch):
    """ctx_b is the lower-case phrase after the context's last ".", "!" or "?": a lower-case word after an earlier
    one is the text's own (task 3471's "u.s. citizens or u.s. nationals." stays so)."""
    assert load_hellaswag()[3471].requests[0][0].endswith("must also be u.s. citizens or u.s. nationals.")
    (tmp_path / "hellaswag").mkdir()
    (tmp_path / "hellaswag" / "hellaswag_val_full.txt").write_text(
        "Cheering: The crowd stands up! they\n0\n" + "clap.\n" * 4 + "Asking: Who is it? the man\n1\n" + "asks.\n" * 4,
        encoding="utf-8")
    monkeypatch.setenv("NIBBLE_DATA", str(tmp_path))
    assert [d.requests[0][0] for d in load_hellaswag()] == ["Cheering: The crowd stands up! They",
                                                           "Asking: Who is it? The man"]


def test_hellaswag_endings_that_still_hold_a_bracketed_span_lose_it_as_lm_eval_preprocesses_them():
    """Endings carry `[...]` spans too (task 5760's "[not recommended]", 6714's "[insert name]"): choice and
    continuation both without them, as lm-eval's `preprocess` of each ending leaves them."""
    docs = load_hellaswag()
    finish = ("Use a remover to get rid of any old nail polish. This is essential unless you want an uneven or lumpy "
              "finish .")
    assert docs[5760].choices[1] == finish and docs[5760].requests[1][1] == " " + finish
    assert docs[6714].choices[0].startswith("As you shake the person's hand, you can say, \" hello, . \" if a")


def test_hellaswag_preprocess_is_not_applied_twice_to_a_line_without_brackets():
    """lm-eval's preprocess collapses "  " once (replace, not a loop): three spaces left by its removed markers
    stay two, as in task 4121's second ending. The shared file already holds that single pass; a second one made
    the double space single, and changed that continuation's tokens and its length for acc_norm."""
    ending = load_hellaswag()[4121].requests[1][1]
    assert "give yourself a break before going to bed.  Do not be embarrassed" in ending
    raw = "give yourself a break before going to bed. [step] [substeps] Do not be embarrassed"  # three spaces
    assert hellaswag_preprocess(raw) == "give yourself a break before going to bed.  Do not be embarrassed"


def test_winogrande_requests_use_partial_scoring():
    docs = load_winogrande()
    assert len(docs) == 1267
    a = "Sarah was a much better surgeon than Maria so Sarah"
    b = "Sarah was a much better surgeon than Maria so Maria"
    assert docs[0].requests == [(a, " always got the easier cases."), (b, " always got the easier cases.")]
    assert docs[0].gold == 1 and docs[1].gold == 0  # dev-labels.lst: 2, 1


# --- tokenization and log-likelihood ---


def test_encode_pair_moves_trailing_context_spaces_and_splits_the_whole_encoding(bpe_tokenizer):
    enc = lambda s: bpe_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    yes = enc(" yes")
    assert len(yes) == 1  # "Ġyes" is one token, so encoding "Answer: " and "yes" apart would differ
    assert encode_pair(bpe_tokenizer, "Answer: ", "yes") == (enc("Answer:"), yes)
    assert encode_pair(bpe_tokenizer, "Answer:", " yes") == (enc("Answer:"), yes)
    ctx, cont = "Question: dresser\nAnswer:", " finish, woodgrain with  bobby pin "
    assert encode_pair(bpe_tokenizer, ctx, cont) == (enc(ctx), enc(ctx + cont)[len(enc(ctx)) :])
    assert encode_pair(bpe_tokenizer, "", "yes") == ([bpe_tokenizer.bos_token_id], enc("yes"))


def test_encode_pair_moves_every_kind_of_trailing_whitespace_into_the_continuation():
    """lm-eval's `context.rstrip()`: a trailing newline or tab moves as a space does."""
    tok = ByteTokenizer()
    assert encode_pair(tok, "ab\n\t ", "cd") == (tok.encode("ab"), tok.encode("\n\t cd"))


def test_encode_pair_encodes_without_the_tokenizers_special_tokens():
    """No BOS before the context, nor inside the whole string the continuation is cut from (it would shift the cut
    by one token)."""

    class BosTokenizer(ByteTokenizer):
        def encode(self, text, add_special_tokens=True):
            return [1] * add_special_tokens + super().encode(text)

    assert encode_pair(BosTokenizer(), "ab", "cd") == ([97, 98], [99, 100])


class GreedyTokenizer:
    """Longest match first, with one merged piece: "ab" + "cd" encodes as a, bc, d, the context "ab" alone as a, b."""

    bos_token_id = eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        ids = []
        while text:
            merged = text.startswith("bc")
            ids.append(256 if merged else ord(text[0]))
            text = text[1 + merged:]
        return ids


def test_a_merge_across_the_boundary_is_split_off_the_whole_encoding_as_lm_eval_does():
    """lm-eval's continuation is the whole string's tokens past the context's own: d alone here (the merged bc is
    neither's), not the continuation encoded apart (c, d). The tokenizers above split at every space and byte, where
    the two agree."""
    assert encode_pair(GreedyTokenizer(), "ab", "cd") == ([ord("a"), ord("b")], [ord("d")])


@pytest.mark.parametrize("bos, prefix", [(1, 1), (None, 2)])
def test_a_context_free_continuation_follows_the_bos_token_or_else_the_eos_token(bos, prefix):
    """Llama-style ids (BOS 1, EOS 2): the tokenizers above have one special token for both, so either would do."""
    tokenizer = ByteTokenizer()
    tokenizer.bos_token_id, tokenizer.eos_token_id = bos, 2
    assert encode_pair(tokenizer, "", "ab") == ([prefix], [ord("a"), ord("b")])


def test_a_continuation_longer_than_the_context_is_refused_and_one_that_fills_it_is_scored():
    model = tiny_model(max_position_embeddings=8)
    with pytest.raises(ValueError, match=r"Request 0: the continuation alone exceeds the model's context \(8\)"):
        loglikelihood(model, ByteTokenizer(), [("a", "x" * 9)], progress=False)
    full = ByteTokenizer().encode("a" + "x" * 8)
    with torch.no_grad():  # the 8 input positions predict all 8 continuation tokens
        lp = torch.log_softmax(model(torch.tensor([full[:-1]])).logits[0].double(), dim=-1)
    by_hand = sum(lp[j, full[j + 1]].item() for j in range(8))
    got = loglikelihood(model, ByteTokenizer(), [("a", "x" * 8)], progress=False)[0]
    assert got == pytest.approx(by_hand, rel=1e-5)


@pytest.mark.parametrize("context, continuation, message", [
    ("ab", "", r"^Request 0 has an empty continuation after tokenization: ''$"),
    ("  ", "cd", r"^Request 0: the context '  ' encodes to no tokens; give a non-blank context\.$")])
def test_a_request_with_no_continuation_or_a_blank_context_is_refused(context, continuation, message):
    """Either was scored: an empty continuation as 0.0 (a certain answer), a blank context by logits of positions
    that predict other tokens."""
    with pytest.raises(ValueError, match=message):
        loglikelihood(BigramLM(), ByteTokenizer(), [(context, continuation)], progress=False)


def test_loglikelihood_sums_continuation_log_probs_given_the_context():
    model = BigramLM(boost=[("b", "c", 2.0), ("c", "d", -1.0)])
    lp = torch.log_softmax(model.table.detach().double(), dim=-1)
    by_hand = lp[ord("b"), ord("c")] + lp[ord("c"), ord("d")]
    got = loglikelihood(model, ByteTokenizer(), [("ab", "cd"), ("ab ", "cd")], progress=False)
    assert got[0] == pytest.approx(by_hand.item(), rel=1e-6)
    # "ab " + "cd" scores " cd" after "ab": the moved space is part of the continuation
    by_hand = lp[ord("b"), ord(" ")] + lp[ord(" "), ord("c")] + lp[ord("c"), ord("d")]
    assert got[1] == pytest.approx(by_hand.item(), rel=1e-6)


def test_long_inputs_lose_tokens_on_the_left_like_lm_eval():
    model = tiny_model(max_position_embeddings=32)
    tok = ByteTokenizer()
    context, continuation = "x" * 40 + "The end of a long context", " and more"
    full = tok.encode(context + continuation)
    inp = torch.tensor(full[-33:-1])  # the last max_len + 1 tokens, minus the last one
    with torch.no_grad():
        lp = torch.log_softmax(model(inp[None]).logits[0].double(), dim=-1)
    k = len(continuation)
    by_hand = sum(lp[len(inp) - k + j, full[-k + j]].item() for j in range(k))
    got = loglikelihood(model, tok, [(context, continuation)], progress=False)[0]
    assert got == pytest.approx(by_hand, rel=1e-5)


@pytest.mark.parametrize("memory, says", [(2 * 5 * 256 * 4 - 1, r"a forward pass of 2 inputs of 5 tokens "
                                                               r"\(batch_size=16\) makes 10.00 KiB of logits \(256 "
                                                               r"float32 values a token\), more than a test's bytes: "
                                                               r"give a smaller batch_size \(each of the inputs: 5.00"),
                                          (5 * 256 * 4 - 1, "one input's logits alone exceed it"),
                                          (2 * 5 * 256 * 4, None)])
def test_a_batch_whose_logits_exceed_the_memory_is_refused_before_it_runs(memory, says, monkeypatch):
    """The first batch holds the longest inputs: where their logits alone exceed the device's memory, the batch is
    refused in its sizes, not run into the kernel's out-of-memory kill."""
    import nibble.eval.perplexity as ppl

    monkeypatch.setattr(ppl, "memory_bound", lambda device: (memory, "a test's bytes"))
    # two inputs, of 5 and 2 tokens (the continuation's last token is no input): the first and last share theirs
    requests = [("abcd", "ef"), ("ab", "c"), ("abcd", "eg")]
    model = tiny_model()
    if says:
        with pytest.raises(ValueError, match=says):
            loglikelihood(model, ByteTokenizer(), requests, progress=False)
    else:
        assert len(loglikelihood(model, ByteTokenizer(), requests, progress=False)) == 3


def test_the_bar_counts_requests_where_several_share_one_forward_pass(capsys):
    """BoolQ's " no" and " yes" share their input: the bar counts both requests, and ends at its total."""
    loglikelihood(BigramLM(), ByteTokenizer(), [("ab", "c"), ("ab", "d"), ("x", "yz")], desc="boolq")
    assert "boolq: 100%" in capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]


def test_batched_loglikelihood_equals_unbatched(bpe_tokenizer):
    model = tiny_model(vocab_size=len(bpe_tokenizer), max_position_embeddings=1024)
    docs = load_piqa()[:3] + load_boolq()[2:3] + load_arc_easy()[:1] + load_winogrande()[:2]
    requests = [r for d in docs for r in d.requests]  # lengths from ~20 to ~300 tokens
    one = loglikelihood(model, bpe_tokenizer, requests, batch_size=1, progress=False)
    many = loglikelihood(model, bpe_tokenizer, requests, batch_size=5, progress=False)
    assert many == pytest.approx(one, rel=1e-5, abs=1e-4)
    assert all(math.isfinite(x) and x < 0 for x in one)


# --- scoring ---


def test_score_docs_takes_argmax_of_loglikelihood_and_of_loglikelihood_per_character():
    docs = [Doc([("", "")] * 2, ["a", "bbbb"], 0),
            Doc([("", "")] * 2, ["a", "bbbb"], 1),
            Doc([("", "")] * 3, ["ab", "ab", "abcd"], 0)]
    lls = [-2.0, -4.0,  # acc picks 0 (-2 > -4); acc_norm picks 1 (-2/1 < -4/4)
           -2.0, -4.0,
           -3.0, -3.0, -8.0]  # ties go to the first choice in both
    # lm-eval's standard error of a mean of hits: sqrt(p (1 - p) / (n - 1))
    se = math.sqrt(2 / 3 * 1 / 3 / 2)
    assert score_docs(docs, lls, has_acc_norm=True) == pytest.approx(
        {"acc": 2 / 3, "acc_stderr": se, "acc_norm": 2 / 3, "acc_norm_stderr": se, "n": 3})
    assert score_docs(docs, lls, has_acc_norm=False) == pytest.approx({"acc": 2 / 3, "acc_stderr": se, "n": 3})
    # one document: no spread to estimate a standard error from, lm-eval's "N/A" (0.0 read as an exact score)
    one = score_docs(docs[:1], lls[:2], has_acc_norm=True)
    assert (one["acc"], one["acc_norm"], one["n"]) == (1.0, 0.0, 1)
    assert math.isnan(one["acc_stderr"]) and math.isnan(one["acc_norm_stderr"])
    nan = score_docs(docs, lls[:5] + [float("nan"), -8.0], has_acc_norm=True)  # np.argmax took the NaN: a guess
    assert all(math.isnan(nan[k]) for k in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")) and nan["n"] == 3


def test_each_document_scores_its_own_log_likelihoods_whatever_its_number_of_choices():
    """A 3-choice document takes 3 log-likelihoods, and the 2-choice one after it the next 2 (ARC's 3- and 5-choice
    questions among 4-choice ones)."""
    docs = [Doc([("", "")] * 3, ["a", "b", "c"], 2), Doc([("", "")] * 2, ["a", "b"], 1)]
    assert score_docs(docs, [-3.0, -2.0, -1.0, -5.0, -4.0], has_acc_norm=True)["acc"] == 1.0


def test_acc_and_acc_norm_each_have_the_standard_error_of_their_own_hits():
    """acc hits all three (standard error 0), acc_norm two of three: the two spreads differ."""
    doc = Doc([("", "")] * 2, ["a", "bbbb"], 0)
    # per character acc_norm picks b, then a (a tie) twice
    result = score_docs([doc] * 3, [-2.0, -4.0, -2.0, -8.0, -2.0, -8.0], has_acc_norm=True)
    assert result == pytest.approx({"acc": 1.0, "acc_stderr": 0.0, "acc_norm": 2 / 3,
                                    "acc_norm_stderr": math.sqrt(2 / 3 * 1 / 3 / 2), "n": 3})


def test_acc_norm_divides_by_the_choices_length_in_characters_not_bytes_or_words():
    """lm-eval's acc_norm is ll / len(choice), Python's len: characters (its acc_bytes is another metric). Every choice
    in the other tests was one ASCII word, where characters, bytes and words order the choices alike. Here each order
    picks another choice: "éééé" is 4 characters and 8 bytes, "ab cd ef" 8 characters and 3 words."""
    docs = [Doc([("", "")] * 2, ["éééé", "abcde"], 1),  # per character -1.1 < -1.0; per byte -0.55 > -1.0
            Doc([("", "")] * 2, ["ab cd ef", "abcdefg"], 1)]  # per character -1.0 < -0.9; per word -2.7 > -6.3
    result = score_docs(docs, [-4.4, -5.0, -8.0, -6.3], has_acc_norm=True)
    assert result["acc_norm"] == 1.0 and result["acc"] == 0.5


def test_uniform_model_acc_picks_the_shortest_choice_and_acc_norm_the_longest():
    # Every byte has log-prob -log 256, so ll = -(1 + len(choice)) log 256: acc prefers the shortest
    # choice, acc_norm (ll / len(choice)) the longest. PIQA's first 3 docs (sol lengths, gold):
    # 164 < 166, gold 0 | 30 < 34, gold 1 | 65 > 55, gold 1
    out = evaluate_tasks(BigramLM(), ByteTokenizer(), ["piqa", "boolq"], limit=3, progress=False)
    se = math.sqrt(2 / 3 * 1 / 3 / 2)
    assert out["piqa"] == pytest.approx({"acc": 2 / 3, "acc_stderr": se, "acc_norm": 1 / 3, "acc_norm_stderr": se,
                                         "n": 3})
    # " no" is shorter than " yes"; labels false, true, true
    assert out["boolq"] == pytest.approx({"acc": 1 / 3, "acc_stderr": se, "n": 3})
    assert out["average"] == {"acc": pytest.approx(0.5)}


def test_winogrande_scores_the_same_continuation_after_each_filled_context():
    # doc 0: "... so Sarah" / "... so Maria" + " always got the easier cases.", gold 1 (Maria)
    after_maria = BigramLM(boost=[("a", " ", 5.0)])
    after_sarah = BigramLM(boost=[("h", " ", 5.0)])
    assert evaluate_tasks(after_maria, ByteTokenizer(), "winogrande", limit=1, progress=False)["winogrande"]["acc"] == 1.0
    assert evaluate_tasks(after_sarah, ByteTokenizer(), "winogrande", limit=1, progress=False)["winogrande"]["acc"] == 0.0


def test_limit_keeps_the_first_documents_of_every_task():
    out = evaluate_tasks(BigramLM(), ByteTokenizer(), limit=2, batch_size=8, progress=False)
    assert list(out) == [*ALL_TASKS, "average"]
    assert all(out[t]["n"] == 2 for t in ALL_TASKS)
    assert ("acc_norm" in out["hellaswag"]) and ("acc_norm" not in out["winogrande"])
    assert out["average"]["acc"] == pytest.approx(sum(out[t]["acc"] for t in ALL_TASKS) / len(ALL_TASKS))



def test_the_average_is_the_unweighted_mean_of_the_tasks_accuracies(monkeypatch):
    """Each task counts once, whatever its number of documents (README's and lm-eval's average of the seven). Every
    other test ran its tasks on equally many documents (limit), where a mean over documents is the same number."""
    hit = Doc([("q", " a"), ("q", " bb")], ["a", "bb"], 0)  # a uniform model picks the shorter continuation
    miss = hit._replace(gold=1)
    monkeypatch.setitem(TASKS, "boolq", Task(lambda: [hit], False))
    monkeypatch.setitem(TASKS, "winogrande", Task(lambda: [miss] * 3, False))
    out = evaluate_tasks(BigramLM(), ByteTokenizer(), ["boolq", "winogrande"], progress=False)
    assert (out["boolq"]["acc"], out["winogrande"]["acc"]) == (1.0, 0.0)
    assert out["average"] == {"acc": 0.5}  # over documents: 0.25


def test_each_task_the_command_line_offers_has_its_data_files_and_loader_in_the_same_order():
    """The task names are listed in nibble.eval, where `--tasks` of `nibble eval` and `nibble report` reads them
    without importing torch, apart from this module's loaders and data files: one named there alone would be offered
    and then fail, one here alone never offered."""
    assert tuple(TASKS) == tuple(FILES) == ALL_TASKS


def test_each_task_loads_its_own_documents_and_reports_acc_norm_where_lm_eval_does():
    """acc_norm for PIQA, HellaSwag, ARC and OpenBookQA; acc alone for WinoGrande and BoolQ (lm-eval's task yamls)."""
    sizes = {"piqa": 1838, "hellaswag": 10042, "winogrande": 1267, "arc_easy": 2376, "arc_challenge": 1172,
             "boolq": 3270, "openbookqa": 500}
    assert {name: len(task.load()) for name, task in TASKS.items()} == sizes
    assert {name for name, task in TASKS.items() if task.has_acc_norm} == {
        "piqa", "hellaswag", "arc_easy", "arc_challenge", "openbookqa"}


def test_unknown_task_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown task.*'piqa'"):
        evaluate_tasks(BigramLM(), ByteTokenizer(), ["piqa", "mmlu"])


def test_the_data_files_checked_before_a_run_are_every_file_each_task_reads():
    """PIQA reads its labels too: a run whose labels file is missing is refused before the model loads."""
    assert task_files(["piqa", "boolq"]) == ["piqa/valid.jsonl", "piqa/valid-labels.lst", "boolq/val.jsonl"]
    assert task_files("winogrande") == ["winogrande/winogrande_dev_llmfoundry.jsonl"]


def test_no_task_is_a_clear_error():
    """An empty list scored nothing and averaged NaN."""
    with pytest.raises(ValueError, match=r"^No tasks given; choose from \['piqa', "):
        evaluate_tasks(BigramLM(), ByteTokenizer(), [], progress=False)


@pytest.mark.parametrize("kwargs, message", [(dict(limit=0), "limit must be an integer >= 1, got 0"),
                                             (dict(limit=-2), "limit must be an integer >= 1"),
                                             (dict(limit=2.5), r"limit must be an integer >= 1, got 2\.5"),
                                             (dict(limit="5"), "limit must be an integer >= 1, got '5'"),
                                             (dict(limit=True), "limit must be an integer >= 1, got True"),
                                             (dict(batch_size=0), "batch_size must be an integer >= 1"),
                                             (dict(batch_size=1.5), "batch_size must be an integer >= 1")])
def test_no_documents_or_an_empty_batch_is_a_clear_error(kwargs, message):
    """limit=0 scored no document: acc NaN, which json.dumps writes as NaN (not JSON); batch_size=0 raised
    range()'s "arg 3 must not be zero". limit=2.5 was blamed on the data file (a DataFormatError of the slice's
    "indices must be integers"), "5" gave a bare TypeError of '<', and True ran one document."""
    with pytest.raises(ValueError, match=message):
        evaluate_tasks(BigramLM(), ByteTokenizer(), ["boolq"], progress=False, **kwargs)


_BAD_FILES = [
    ("piqa", "piqa/valid.jsonl", '{"goal": "a", "sol1": "b", "sol2": "c"}\n{"goal": "cut sho', r"valid\.jsonl, line 2: not in the format"),
    ("piqa", "piqa/valid.jsonl", '{"question": "a", "sol1": "b", "sol2": "c"}\n', r"KeyError: 'goal'"),
    ("boolq", "boolq/val.jsonl", '{"passage": "p", "question": "q", "label": true}\n', r"KeyError: True"),
    ("arc_easy", "arc/ARC-Easy-Test.jsonl",
     '{"question": {"stem": "s", "choices": [{"label": "A", "text": "t"}]}, "answerKey": "ZA"}\n', r"'ZA' is not in list"),
    ("hellaswag", "hellaswag/hellaswag_val_full.txt", "", r"no hellaswag document in it"),
    ("winogrande", "winogrande/winogrande_dev_llmfoundry.jsonl", b'{"context_options": ["\xe9"]}\n',
     r"UnicodeDecodeError"),
]


@pytest.mark.parametrize("task,relpath,content,message", _BAD_FILES, ids=[f"{t[0]}-{i}" for i, t in enumerate(_BAD_FILES)])
def test_a_malformed_data_file_is_named_with_what_to_do(task, relpath, content, message, monkeypatch, tmp_path):
    """A truncated line read as "Expecting value: line 2 column 1", a missing key as a bare KeyError traceback."""
    from nibble.eval.data import DataFormatError
    path = tmp_path / relpath
    path.parent.mkdir(parents=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    if task == "piqa":
        (tmp_path / "piqa/valid-labels.lst").write_text("0\n")
    monkeypatch.setenv("NIBBLE_DATA", str(tmp_path))
    with pytest.raises(DataFormatError, match=f"{tmp_path}.*{message}.*copy the file again from the shared data"):
        evaluate_tasks(None, None, tasks=[task], progress=False)


@pytest.mark.parametrize("labels", ["0\n", "0\n1\n0\n"])
def test_piqa_labels_that_are_not_one_a_question_are_refused_naming_both_files(labels, monkeypatch, tmp_path):
    """Fewer labels than questions, or more: the two files do not align, and every gold after the first gap would be
    another question's."""
    (tmp_path / "piqa").mkdir()
    (tmp_path / "piqa" / "valid.jsonl").write_text('{"goal": "g", "sol1": "a", "sol2": "b"}\n' * 2)
    (tmp_path / "piqa" / "valid-labels.lst").write_text(labels)
    monkeypatch.setenv("NIBBLE_DATA", str(tmp_path))
    n = len(labels.split())
    with pytest.raises(DataFormatError, match=rf"valid\.jsonl and .*valid-labels\.lst: not in the format nibble reads "
                                              rf"\(ValueError: piqa: 2 questions but {n} labels; the two files must"):
        evaluate_tasks(BigramLM(), ByteTokenizer(), "piqa", progress=False)


@pytest.mark.parametrize("bad_gold", [2, -1])
def test_a_gold_that_is_no_index_of_the_choices_is_refused_naming_the_file(tmp_path, monkeypatch, bad_gold):
    """WinoGrande with 1/2 labels (dev-labels.lst's convention) scored acc 0.30 for 0.55: a gold of 2 is never hit,
    nor one of -1 (an argmax is never -1: every document a silent miss)."""
    import json

    folder = tmp_path / "winogrande"
    folder.mkdir()
    docs = [{"context_options": ["The cat sat", "The dog sat"], "continuation": "on the mat.", "gold": gold}
            for gold in (1, bad_gold)]
    (folder / "winogrande_dev_llmfoundry.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    monkeypatch.setenv("NIBBLE_DATA", str(tmp_path))
    with pytest.raises(DataFormatError, match=rf"winogrande_dev_llmfoundry.jsonl: document 1 has the gold answer "
                                              rf"{bad_gold}, not the index of one of its 2 choices \(0 to 1\)"):
        evaluate_tasks(BigramLM(), ByteTokenizer(), "winogrande", progress=False)


@pytest.mark.parametrize("bad_gold", [True, "1", 1.0])
def test_a_gold_that_is_no_integer_is_refused_naming_the_file(tmp_path, monkeypatch, bad_gold):
    """JSON's true, "1" or 1.0 is no index of a choice, though True == 1 == 1.0 in Python."""
    import json

    (tmp_path / "winogrande").mkdir()
    doc = {"context_options": ["The cat sat", "The dog sat"], "continuation": "on the mat.", "gold": bad_gold}
    (tmp_path / "winogrande" / "winogrande_dev_llmfoundry.jsonl").write_text(json.dumps(doc) + "\n")
    monkeypatch.setenv("NIBBLE_DATA", str(tmp_path))
    with pytest.raises(DataFormatError, match=rf"document 0 has the gold answer {bad_gold!r}, not the index of one of"):
        evaluate_tasks(BigramLM(), ByteTokenizer(), "winogrande", progress=False)


def test_a_hellaswag_file_cut_mid_task_is_refused(tmp_path, monkeypatch):
    """Its last, partial task was dropped without a word (only n showed it)."""
    whole = data.data_file("hellaswag/hellaswag_val_full.txt").read_text(encoding="utf-8").split("\n")[:12]
    (tmp_path / "hellaswag").mkdir()
    (tmp_path / "hellaswag" / "hellaswag_val_full.txt").write_text("\n".join(whole[:11]) + "\n", encoding="utf-8")
    monkeypatch.setenv("NIBBLE_DATA", str(tmp_path))
    with pytest.raises(DataFormatError, match="11 lines, not whole tasks of 6"):
        evaluate_tasks(BigramLM(), ByteTokenizer(), "hellaswag", progress=False)
    (tmp_path / "hellaswag" / "hellaswag_val_full.txt").write_text("\n".join(whole) + "\n", encoding="utf-8")
    assert evaluate_tasks(BigramLM(), ByteTokenizer(), "hellaswag", progress=False)["hellaswag"]["n"] == 2

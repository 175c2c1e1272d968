"""The engine's generation beyond greedy tokens of one prompt length: sampled decoding (the filters
against transformers' warpers, the draws against the distribution they leave, seeds, the CUDA graph
path; GPU tests skip without CUDA), streamed chunks, and batches of prompts of different lengths."""
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from conftest import past_stop, tiny_model
from nibble import QuantConfig, quantize_model
from nibble.eval import engine as engine_mod
from nibble.eval.engine import GREEDY, Engine, Sampling, next_tokens, prompt_batch, sampling_logits

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("seed", range(6))
def test_the_filters_leave_out_the_tokens_transformers_warpers_leave_out(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(40):
        V = int(torch.randint(2, 400, (1,), generator=g))
        logits = torch.randn(5, V, generator=g) * float(1 + 4 * torch.rand(1, generator=g))
        temperature = float(0.1 + 2 * torch.rand(1, generator=g))
        top_k = int(torch.randint(1, V + 4, (1,), generator=g)) if seed % 2 else None
        top_p = float(0.01 + torch.rand(1, generator=g)) if seed % 3 else 1.0
        top_p = min(top_p, 1.0)
        ours = sampling_logits(logits, Sampling(temperature, top_k, top_p))
        ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k is not None:
            ref = TopKLogitsWarper(top_k)(None, ref)
        if top_p < 1:
            ref = TopPLogitsWarper(top_p)(None, ref)
        assert torch.equal(ours == -torch.inf, ref == -torch.inf)
        kept = ours > -torch.inf
        torch.testing.assert_close(ours[kept], ref[kept])


@pytest.mark.parametrize("top_k", range(1, 7))
def test_top_k_keeps_k_tokens_up_to_and_past_the_vocabulary(top_k):
    """top_k = V - 1 leaves out exactly the least likely token: the random vocabularies above seldom draw that k."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    ours = sampling_logits(logits, Sampling(1.0, top_k))
    assert int((ours > -torch.inf).sum()) == min(top_k, 4)
    assert torch.equal(ours == -torch.inf, TopKLogitsWarper(top_k)(None, logits.clone()) == -torch.inf)


@pytest.mark.parametrize("sampling", [Sampling(0.7), Sampling(1.3, top_k=3), Sampling(1.0, top_p=0.75),
                                      Sampling(0.9, top_k=4, top_p=0.9)])
def test_draws_follow_the_filtered_softmax(sampling):
    logits = torch.tensor([2.0, 1.5, -0.5, 0.7, 1.1, -2.0, 0.0, 1.9])
    expect = sampling_logits(logits[None], sampling).softmax(-1)[0].double()
    n = 40000
    torch.manual_seed(0)
    drawn = next_tokens(logits.expand(n, -1), sampling)
    freq = torch.bincount(drawn, minlength=logits.numel()).double() / n
    assert torch.all(freq[expect == 0] == 0)  # a token the filters leave out is never drawn
    sigma = (expect * (1 - expect) / n).sqrt()
    assert torch.all((freq - expect).abs() <= 5 * sigma + 1e-12), (freq, expect)


def test_tokens_tied_with_the_last_one_a_filter_keeps_all_stay():
    # probabilities ~.47 / .17 / .17 / .17 / .02: top-p .6 ends inside the tied tokens, top-k 2 too
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, -1.0]])
    for sampling in (Sampling(1.0, top_p=0.6), Sampling(1.0, top_k=2), Sampling(1.0, top_k=3, top_p=0.55)):
        assert torch.equal(sampling_logits(logits, sampling) > -torch.inf, torch.tensor([[True] * 4 + [False]]))
    assert torch.equal(sampling_logits(logits, Sampling(1.0, top_p=0.4)) > -torch.inf,
                       torch.tensor([[True] + [False] * 4]))


def test_a_nucleus_smaller_than_the_top_token_keeps_the_top_token():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    assert torch.equal(next_tokens(logits, Sampling(1.0, top_p=1e-6)), logits.argmax(-1))


def test_a_nucleus_that_reaches_top_p_exactly_ends_there_as_transformers_does():
    """Probabilities 1/2, 1/4, 1/8, 1/16, 1/16 (exact in float32): a token whose more likely ones hold exactly top_p
    is left out (transformers' warper too); kept at the boundary, the nucleus was one token larger."""
    logits = torch.tensor([[1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 16]]).log()
    assert torch.equal(logits.softmax(-1), logits.exp())  # the boundary below is exact
    for kept, top_p in ((1, 0.5), (2, 0.75), (3, 0.875)):
        ours = sampling_logits(logits, Sampling(1.0, top_p=top_p)) > -torch.inf
        assert torch.equal(ours, (torch.arange(5) < kept)[None])
        assert torch.equal(ours, TopPLogitsWarper(top_p)(None, logits.clone()) > -torch.inf)


def test_a_race_draw_of_zero_picks_no_token_the_filters_left_out(monkeypatch):
    """Exp(1) draws of exactly 0 (-log u at u = 1): unclamped, a token the filters left out got 0 / 0, a NaN, which
    argmax picks."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *args, **kwargs: self.zero_())
    for sampling in (Sampling(1.0, top_k=3), Sampling(0.7, top_p=0.5)):
        drawn = next_tokens(logits, sampling)
        assert bool(sampling_logits(logits, sampling).gather(1, drawn[:, None]).isfinite().all()), drawn


def test_greedy_sampling_is_the_argmax():
    logits = torch.randn(7, 30, generator=torch.Generator().manual_seed(2))
    # a temperature below float32's reach is its limit, greedy (logits / 1e-40 overflowed: every token came out 0)
    for sampling in (GREEDY, Sampling(0.0, top_k=5, top_p=0.5), Sampling(3.0, top_k=1), Sampling(1e-40)):
        assert sampling.greedy and torch.equal(next_tokens(logits, sampling), logits.argmax(-1))
    with pytest.warns(UserWarning, match="decoding is greedy"):  # as greedy as temperature 0, and said so
        Sampling(1e-40, top_k=5).warn_if_filters_unused()


def test_top_k_given_to_greedy_decoding_is_said_at_the_callers_line():
    """Its fixed stacklevel, counted from `stream` (a generator: which frames lie above it depends on how it is run),
    named the line above the caller's for a call of `stream` itself (Python 3.11)."""
    engine, prompt = Engine(tiny_model(), max_seq_len=16), torch.zeros(1, 4, dtype=torch.long)
    with pytest.warns(UserWarning, match="decoding is greedy") as streamed:
        next(engine.stream(prompt, 2, top_k=5))
    with pytest.warns(UserWarning, match="decoding is greedy") as generated:
        engine.generate(prompt, 2, top_k=5)
    assert [w.filename for w in (*streamed, *generated)] == [__file__] * 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be"), (dict(temperature=float("nan")), "temperature must be"),
    (dict(top_k=0), "top_k must be"), (dict(top_k=2.5), "top_k must be"),
    (dict(top_p=0.0), "top_p must be"), (dict(top_p=1.5), "top_p must be"),
    (dict(temperature=True, top_k=5), "temperature must be"), (dict(temperature=1.0, top_k=True), "top_k must be"),
    # an infinite temperature passed a NaN check alone (logits / inf: every token alike); True passed 0 < top_p <= 1
    (dict(temperature=float("inf")), "temperature must be"), (dict(temperature=1.0, top_p=True), "top_p must be")])
def test_bad_sampling_settings_say_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**kwargs)
    with pytest.raises(ValueError, match=message):
        Engine(tiny_model(), max_seq_len=16).generate(torch.zeros(1, 4, dtype=torch.long), 4, **kwargs)


def _sampled_runs(engine, prompt, n, **kwargs):
    torch.manual_seed(5)
    first = engine.generate(prompt, n, **kwargs)
    torch.manual_seed(5)
    again = engine.generate(prompt, n, **kwargs)
    torch.manual_seed(6)
    other = engine.generate(prompt, n, **kwargs)
    return first, again, other


def test_engine_samples_repeat_with_the_seed_and_top_k_1_is_greedy():
    model = tiny_model(initializer_range=0.2)
    prompt = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    engine = Engine(model, max_batch=2, max_seq_len=48)
    greedy = engine.generate(prompt, 24)
    first, again, other = _sampled_runs(engine, prompt, 24, temperature=5.0)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert not torch.equal(first, greedy)  # flattened by the temperature: 48 draws all greedy is ~impossible
    assert first.min() >= 0 and first.max() < model.config.vocab_size
    assert torch.equal(engine.generate(prompt, 24, temperature=5.0, top_k=1), greedy)
    assert torch.equal(engine.generate(prompt, 24), greedy)  # sampling left no state behind


def test_every_token_of_a_sampled_generation_is_drawn_the_prefills_too():
    """Against each token's greedy pick given the tokens before it (one forward of the model): a prefill that picked
    greedily, or decode steps that did, still made sequences unlike the greedy one, as the test above asks."""
    model = tiny_model(initializer_range=0.2)
    prompt = torch.randint(0, 256, (4, 6), generator=torch.Generator().manual_seed(9))
    engine = Engine(model, max_batch=4, max_seq_len=32)
    torch.manual_seed(1)
    sampled = engine.generate(prompt, 12, temperature=5.0)
    with torch.no_grad():
        greedy = model(torch.cat([prompt, sampled], 1)).logits[:, 5:-1].argmax(-1)
    assert not torch.equal(sampled[:, 0], greedy[:, 0])
    assert (sampled[:, 1:] != greedy[:, 1:]).any(1).all()


@gpu
@pytest.mark.gpu
def test_cuda_graph_engine_samples_inside_its_decode_graph():
    model = tiny_model(dtype=torch.bfloat16, initializer_range=0.2).cuda()
    prompt = torch.randint(0, 256, (2, 8), device="cuda")
    engine = Engine(model, max_batch=2, max_seq_len=64)
    greedy = engine.generate(prompt, 40)
    first, again, other = _sampled_runs(engine, prompt, 40, temperature=5.0, top_p=0.95)
    assert ("decode", 2, Sampling(5.0, top_p=0.95)) in engine._graphs and ("decode", 2) in engine._graphs
    assert torch.equal(first, again) and not torch.equal(first, other) and not torch.equal(first, greedy)
    assert first.min() >= 0 and first.max() < model.config.vocab_size
    assert torch.equal(engine.generate(prompt, 40, temperature=5.0, top_k=1), greedy)
    # the graph's draws follow the same distribution as eager ones: a near-uniform one at a high
    # temperature spreads the 80 tokens over many ids
    assert len(set(first.flatten().tolist())) > 40


def test_stream_hands_over_generates_tokens_chunk_by_chunk():
    model = tiny_model(initializer_range=0.2)
    prompt = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    engine = Engine(model, max_batch=2, max_seq_len=48)
    chunks = list(engine.stream(prompt, 20))
    assert [c.shape for c in chunks] == [(2, 1)] * 20  # the CPU checks for stop tokens, and hands over, every step
    assert torch.equal(torch.cat(chunks, dim=1), engine.generate(prompt, 20))
    with pytest.raises(ValueError, match="temperature must be"):
        engine.stream(prompt, 20, temperature=-1.0)  # checked when called, not when first iterated
    with pytest.raises(ValueError, match="max_seq_len=48"):
        engine.stream(prompt, 60)
    for n in (0, -2, 2.5, True):  # True is an int to Python: it made one token
        with pytest.raises(ValueError, match="max_new_tokens must be"):
            engine.generate(prompt, n)


def test_norms_and_mlps_the_engine_does_not_fuse_run_as_the_model_runs_them():
    """A norm that is not HF's RMSNorm (torch's nn.RMSNorm: its eps is no variance_epsilon) and an MLP whose activation
    is not SiLU are called as the model's modules, not fused: logits and tokens as the model's. A fused MLP of another
    activation ran SiLU; a norm fused without its eps failed; an unfused norm was given the layer's output without
    the residual stream, or skipped before such an MLP."""
    g = torch.Generator().manual_seed(7)
    model = tiny_model(hidden_act="gelu", initializer_range=0.2)

    def plain_norm():
        norm = torch.nn.RMSNorm(64, eps=1e-5)
        norm.weight.data = 1 + 0.3 * torch.randn(64, generator=g)
        return norm
    for layer in model.model.layers:
        layer.input_layernorm, layer.post_attention_layernorm = plain_norm(), plain_norm()
    model.model.norm = plain_norm()
    prompt = torch.randint(0, 256, (2, 7), generator=g)
    engine = Engine(model, max_batch=2, max_seq_len=32)
    with torch.no_grad():
        torch.testing.assert_close(engine.prefill(prompt), model(prompt).logits[:, -1], rtol=1e-4, atol=1e-5)
        want = model.generate(prompt[:1], max_new_tokens=10, do_sample=False)[:, 7:]
    assert torch.equal(engine.generate(prompt[:1], 10), want)


# ---- prompts of different lengths ------------------------------------------------------------
def _ragged_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


def _alone(engine, prompts, n):
    """Each prompt's prefill logits and greedy tokens, run as a batch of one."""
    logits = torch.cat([engine.prefill(p[None]) for p in prompts])
    return logits, torch.cat([engine.generate(p[None], n) for p in prompts])


def test_what_the_cache_holds_past_a_sequences_position_is_never_read():
    """Decode attends over the whole static cache, masked: slots a longer earlier generation left there, however
    large, weigh nothing (a finite mask, -1e4, let large keys past it win the softmax)."""
    model = tiny_model(initializer_range=0.2)
    prompts = _ragged_prompts([7, 3], seed=4)
    engine = Engine(model, max_batch=2, max_seq_len=32)
    clean = engine.generate(prompts, 8)
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():  # the cache's mode
        for cache in (engine.k_cache, engine.v_cache):
            cache[:, :, :, 14:] = 1e4 * torch.randn(cache[:, :, :, 14:].shape, generator=g)
    assert torch.equal(engine.generate(prompts, 8), clean)


@pytest.mark.parametrize("arch, mode", [("llama", None), ("qwen2", None), ("mistral", "w4a16"), ("llama", "w4a4"),
                                        ("qwen3", "w4a4")])
def test_prompts_of_different_lengths_each_run_as_they_would_alone(arch, mode):
    model = tiny_model(arch, initializer_range=0.2)
    if mode:
        quantize_model(model, QuantConfig(mode=mode, group_size=32 if mode == "w4a16" else None), progress=False)
    prompts = _ragged_prompts([5, 11, 1, 8])
    engine = Engine(model, max_batch=4, max_seq_len=40)
    logits, tokens = _alone(engine, prompts, 16)
    torch.testing.assert_close(engine.prefill(prompts), logits, rtol=1e-4, atol=1e-5)
    assert torch.equal(engine.generate(prompts, 16), tokens)
    assert torch.equal(engine.generate([p.tolist() for p in prompts], 16), tokens)  # lists of ids alike
    # and the same prompts at one length run as before: a [B, T] tensor is a batch of equal lengths
    same = torch.stack([p[:1].repeat(6) for p in prompts])
    assert torch.equal(engine.generate(same, 8), engine.generate(list(same), 8))


def test_a_ragged_batch_stops_and_samples_per_sequence():
    model = tiny_model(initializer_range=0.2)
    prompts = _ragged_prompts([9, 2, 6], seed=1)
    engine = Engine(model, max_batch=3, max_seq_len=48)
    full = engine.generate(prompts, 24)
    stops = {full[0, 3].item()}
    ends = [next((i for i, t in enumerate(row) if t in stops), 23) for row in full.tolist()]
    stopped = engine.generate(prompts, 24, stop_tokens=stops)
    # row 0 stopped first: it repeats its stop token, not what it made next (a next turn, say)
    assert torch.equal(stopped, past_stop(full[:, :max(ends) + 1], stops)) and ends[0] < max(ends)
    assert not torch.equal(stopped, full[:, :max(ends) + 1])
    assert torch.equal(engine.generate(prompts, 24, temperature=3.0, top_k=1), full)  # top_k=1 is greedy
    torch.manual_seed(0)
    first = engine.generate(prompts, 24, temperature=3.0)
    torch.manual_seed(0)
    assert torch.equal(engine.generate(prompts, 24, temperature=3.0), first)


def test_a_stream_resumed_after_another_generation_took_the_engine_is_refused():
    """The decode state is the engine's: two open streams (or a generate between two chunks) yielded each other's
    tokens."""
    model = tiny_model(initializer_range=0.2)
    engine = Engine(model, max_seq_len=32)
    a, b = torch.randint(0, 256, (1, 5)), torch.randint(0, 256, (1, 7))
    alone = engine.generate(a, 6)
    stream = engine.stream(a, 6)
    assert torch.equal(next(stream), alone[:, :1])
    assert torch.equal(next(stream), alone[:, 1:2])
    engine.generate(b, 4)
    with pytest.raises(RuntimeError, match="ran another generation .* an Engine per concurrent stream"):
        next(stream)
    stream = engine.stream(a, 6)
    next(stream)
    engine.decode(2)  # steps the stream did not take: its next chunk would skip them
    with pytest.raises(RuntimeError, match="ran another generation"):
        next(stream)
    stream = engine.stream(a, 6)
    next(stream)
    engine.prefill(b)  # a prefill alone takes the engine too: the stream went on decoding b's sequence
    with pytest.raises(RuntimeError, match="ran another generation"):
        next(stream)
    assert torch.equal(torch.cat(list(engine.stream(a, 6)), dim=1), alone)  # a new stream runs as before


def test_prompts_of_any_integer_dtype_run_as_int64_ids():
    """A uint8 prompt tensor reached the embedding as is, which takes int32 and int64 indices only; a prompt may be a
    tuple of ids as well as a list."""
    model = tiny_model(initializer_range=0.2)
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(5))
    engine = Engine(model, max_batch=2, max_seq_len=16)
    want = engine.generate(prompt, 4)
    for dtype in (torch.uint8, torch.int16, torch.int32):
        assert prompt_batch(prompt.to(dtype))[0].dtype == torch.int64
        assert torch.equal(engine.generate(prompt.to(dtype), 4), want)
        assert torch.equal(engine.generate(list(prompt.to(dtype)), 4), want)
    # a list of tuples of ids alike (a tuple prompt was refused as no list of ids)
    assert torch.equal(engine.generate([tuple(p) for p in prompt.tolist()], 4), want)


@pytest.mark.parametrize("prompt, message", [
    ([], "non-empty list of prompts"), ("hello", "tokenize first"), (torch.tensor([1, 2, 3]), r"ids\[None\]"),
    (torch.ones(2, 3), "integer token ids"), (torch.zeros(2, 0, dtype=torch.long), "length >= 1"),
    ([[1, 2], []], "prompt 1 must be"), ([[1, 2], [0.5]], "prompt 1 must be"), ([torch.ones(2, 2).long()], "prompt 0"),
    ([[1], "ab"], "prompt 1 must be"), ([5, 6, 7], r"one prompt is \[ids\]"), ([[1, 2], []], "got an empty one"),
    ([[3], [True, 2]], "prompt 1 must be .* got torch.bool"),  # True passed as id 1, where a bool tensor is refused
    ([[3], [np.True_, 2]], "prompt 1 must be .* got torch.bool"),
    (torch.ones(2, 3, dtype=torch.complex64), "integer token ids"),  # .long() dropped the imaginary part, and ran
    ([[1, 2], 3], "prompt 1 must be .* got int"),  # the prompt at fault named, not the whole list read as one prompt
    ([torch.tensor([1, 2]), torch.tensor([3], device="meta")], "on one device")])  # torch's NotImplementedError
def test_bad_prompts_say_what_a_prompt_must_be(prompt, message):
    with pytest.raises(ValueError, match=message):
        prompt_batch(prompt)
    with pytest.raises(ValueError, match=message):
        Engine(tiny_model(), max_seq_len=16).generate(prompt, 2)


def test_decode_steps_are_checked_before_the_sequences_move():
    """decode(0) failed in torch.stack; decode(-5, collect=False) passed and took the sequences' length back 5, so a
    later decode(10) passed the cache check and ran past the cache (out of bounds writes on CUDA)."""
    engine = Engine(tiny_model(), max_seq_len=16)
    with pytest.raises(RuntimeError, match=r"call prefill\(prompt\) before decode\(\)"):
        engine.decode(1)  # no sequence yet: said, not a forward over a batch of none
    engine.prefill(torch.zeros(1, 10, dtype=torch.long))
    for steps in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="steps must be an integer >= 1"):
            engine.decode(steps, collect=False)
    for steps in (10, 7):  # one step past max_seq_len is refused too, and exactly up to it runs
        with pytest.raises(ValueError, match=rf"10 \+ {steps} positions exceed this engine's max_seq_len=16"):
            engine.decode(steps)
    assert engine.decode(6).shape == (1, 6)
    engine.prefill(torch.zeros(1, 10, dtype=torch.long))
    assert engine.decode(4).shape == (1, 4)
    with pytest.raises(ValueError, match=r"14 \+ 4 positions exceed"):  # the steps taken count: 4 + 4 passed as 10 + 4
        engine.decode(4)


def test_a_closed_engine_says_so():
    """Each call failed with a TypeError from indexing the dropped cache."""
    engine = Engine(tiny_model(), max_seq_len=16)
    prompt = torch.zeros(1, 4, dtype=torch.long)
    stream = engine.stream(prompt, 4)
    next(stream)
    engine.close()
    assert engine.k_cache is None and engine.v_cache is None  # both caches' memory back to the allocator
    for call in (lambda: engine.generate(prompt, 4), lambda: engine.prefill(prompt), lambda: engine.decode(1),
                 lambda: next(stream)):
        with pytest.raises(RuntimeError, match="this engine was closed"):
            call()


def test_a_ragged_batch_is_checked_against_the_cache_by_its_longest_prompt():
    engine = Engine(tiny_model(), max_batch=2, max_seq_len=16)
    tokens, lengths = prompt_batch([[1, 2, 3], list(range(10))])
    assert tokens.shape == (2, 10) and lengths == [3, 10] and tokens[0, 3:].eq(0).all()
    # said in the terms given: 10 + 8 tokens read as miscounted against 17 positions
    with pytest.raises(ValueError, match=r"^17 positions exceed this engine's max_seq_len=16: the longest prompt's 10 "
                                         r"tokens and max_new_tokens=8 but the last, which no step reads; give "
                                         r"max_new_tokens <= 7, or build the Engine with a larger max_seq_len$"):
        engine.generate([[1, 2, 3], list(range(10))], 8)
    with pytest.raises(ValueError, match=r"^18 positions exceed .* the longest prompt's 18 tokens and max_new_tokens=1 "
                                         r"but the last, which no step reads; shorten it to 16 tokens or fewer, or"):
        engine.generate([[1, 2, 3], list(range(18))], 1)
    # room for one new token, or none: said as such (a prompt that fits was told to shorten, or to give 0 tokens)
    with pytest.raises(ValueError, match=r"the longest prompt's 16 tokens .* give max_new_tokens <= 1, or"):
        engine.generate([list(range(16))], 2)
    with pytest.raises(ValueError, match=r"the longest prompt's 17 tokens .* shorten it to 16 tokens or fewer, or"):
        engine.generate([list(range(17))], 1)
    # the cache holds the prompt and the new tokens but the last (which no step reads): 10 + 7 - 1 = 16
    assert engine.generate([[1, 2, 3], list(range(10))], 7).shape == (2, 7)
    assert engine.generate([list(range(16))], 1).shape == (1, 1)  # a prompt that fills the cache: one token
    engine.prefill([[1, 2, 3], list(range(10))])
    with pytest.raises(ValueError, match=r"10 \+ 7 positions exceed"):  # decode's check too: the longest, not 3 + 7
        engine.decode(7)
    with pytest.raises(ValueError, match="max_batch"):
        engine.generate([[1]] * 3, 2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "w4a16", "w4a4"])
def test_cuda_graph_engine_runs_prompts_of_different_lengths(mode):
    model = tiny_model(dtype=torch.bfloat16, initializer_range=0.2).cuda()
    if mode:
        quantize_model(model, QuantConfig(mode=mode, group_size=32 if mode == "w4a16" else None), progress=False)
    engine = Engine(model, max_batch=3, max_seq_len=64)
    for lengths in ([3, 8, 6], [8, 1, 5]):  # the second batch replays the first's graphs with other lengths
        prompts = [p.cuda() for p in _ragged_prompts(lengths, seed=len(engine._graphs))]
        logits, tokens = _alone(engine, prompts, 40)
        # batched and alone, the matmuls may round differently: logits to bf16 rounding, tokens but near-ties
        torch.testing.assert_close(engine.prefill(prompts), logits, rtol=0.02, atol=0.02)
        ragged = engine.generate(prompts, 40)
        assert ("prefill", 3, 8) in engine._graphs
        assert (ragged == tokens).float().mean() > 0.95, (ragged, tokens)


def test_stop_tokens_may_be_one_id_as_transformers_takes_eos_token_id():
    model = tiny_model(initializer_range=0.2)
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(4))
    engine = Engine(model, max_seq_len=40)
    full = engine.generate(prompt, 20)
    eos = full[0, 2].item()
    cut = engine.generate(prompt, 20, stop_tokens=[eos])
    assert cut.shape[1] < 20 and torch.equal(cut, full[:, :cut.shape[1]])
    for one in (eos, torch.tensor(eos), torch.tensor([eos]), torch.tensor([[eos]]), {eos}):  # any tensor's ids
        assert torch.equal(engine.generate(prompt, 20, stop_tokens=one), cut)
    assert torch.equal(engine.generate(prompt, 20, stop_tokens=[]), full)  # none: no stop
    assert torch.equal(engine.generate(prompt, 20, stop_tokens=full[0, 0].item()), full[:, :1])  # the prefill's token
    for bad in ([None], [eos, "x"], [1.5], 5.0, True):
        with pytest.raises(ValueError, match="stop_tokens must be token ids"):
            engine.generate(prompt, 20, stop_tokens=bad)


@pytest.mark.parametrize("stops", [-1, 256, [2, 300]])
def test_stop_tokens_outside_the_vocabulary_are_refused_not_run_to_the_end(stops):
    """The engine never makes such a token, so a stop id of another tokenizer (or -1 for none) ran every sequence to
    max_new_tokens without a word."""
    engine = Engine(tiny_model(), max_seq_len=16)
    with pytest.raises(ValueError, match=r"^stop_tokens' token ids run from .*, but the model's vocabulary has 256 "
                                         r"tokens: give the stop ids of this model's tokenizer"):
        engine.generate(torch.tensor([[1, 2, 3]]), 4, stop_tokens=stops)
    assert engine.generate(torch.tensor([[1, 2, 3]]), 4, stop_tokens=255).shape[0] == 1  # the last id is one


@pytest.mark.parametrize("ids", [[[3, 256]], [[-1, 2]]])
def test_token_ids_outside_the_vocabulary_are_refused_naming_its_size(ids):
    engine = Engine(tiny_model(), max_batch=2, max_seq_len=16)
    said = (rf"^the prompts' token ids run from {min(ids[0])} to {max(ids[0])}, but the model's vocabulary has 256 "
            r"tokens: tokenize the prompts with this model's tokenizer$")  # config.check_token_ids' words, as elsewhere
    with pytest.raises(ValueError, match=said):
        engine.generate(torch.tensor(ids), 2)
    with pytest.raises(ValueError, match="the prompts' token ids run from"):
        engine.generate([[1, 2, 3], ids[0]], 2)  # a ragged batch alike
    with pytest.raises(ValueError, match=said):
        engine.prefill(torch.tensor(ids))  # an IndexError in the embedding, a device assert on CUDA
    assert engine.generate(torch.tensor([[0, 255]]), 2).shape == (1, 2)


def test_engine_sizes_are_checked_when_it_is_built():
    model = tiny_model()  # max_position_embeddings 256
    for kwargs, message in ((dict(max_seq_len=0), "max_seq_len must be an integer >= 1"),
                            (dict(max_seq_len=-4), "max_seq_len must be"), (dict(max_batch=0), "max_batch must be"),
                            (dict(max_batch=1.5), "max_batch must be"),
                            # True is an int to Python: a one-position cache, and max_batch a TypeError from torch.zeros
                            (dict(max_seq_len=True), "max_seq_len must be"), (dict(max_batch=True), "max_batch must be")):
        with pytest.raises(ValueError, match=message):
            Engine(model, **kwargs)
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):  # the CPU's model:
        Engine(model, max_seq_len=16, cuda_graphs=True)  # refused when built, not at the first graph capture
    with pytest.warns(UserWarning, match=r"max_seq_len=300 exceeds the model's context \(256"):
        assert Engine(model, max_seq_len=300).max_seq_len == 300
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # up to the context: no word
        assert Engine(model).max_seq_len == Engine(model, max_seq_len=256).max_seq_len == 256


def test_a_kv_cache_that_cannot_fit_is_refused_in_its_sizes_before_it_is_allocated(monkeypatch):
    """Engine(max_seq_len=10**12) warned of the model's context, then failed in torch's words ("DefaultCPUAllocator:
    can't allocate memory: you tried to allocate 8000000000000 bytes", for the rotary positions)."""
    model = tiny_model()  # 2 layers, 2 KV heads of 16, float32: 512 bytes a position and sequence
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of the context for an engine that is not built
        with pytest.raises(ValueError, match=r"^a KV cache of max_batch=1 x max_seq_len=1000000000000 needs "
                                             r"512000000000000 bytes \(476837\.16 GiB\), more than this machine's "
                                             r".* GiB of memory: lower max_seq_len or max_batch$"):
            Engine(model, max_seq_len=10 ** 12)
    sysconf = os.sysconf
    pages = {"SC_PAGE_SIZE": 8192, "SC_PHYS_PAGES": 16}  # a machine of 128 KiB: a cache of 256 positions fits
    monkeypatch.setattr(os, "sysconf", lambda name: pages.get(name) or sysconf(name))
    assert Engine(model, max_seq_len=256).kv_cache_bytes() == 131072
    with pytest.raises(ValueError, match=r"max_batch=2 x max_seq_len=256 needs 262144 bytes \(256\.00 KiB\), more "
                                         r"than this machine's 128\.00 KiB of memory"):
        Engine(model, max_batch=2, max_seq_len=256)
    with pytest.raises(ValueError, match=r"max_seq_len=257 needs 139264 bytes"):  # the cache rounds up to 16 positions
        Engine(model, max_seq_len=257)
    pages["SC_PAGE_SIZE"] = 4096
    with pytest.raises(ValueError, match=r"max_seq_len=256 \(the default\) needs 131072 bytes"):
        Engine(model)


def test_a_model_built_empty_is_refused_when_the_engine_is_built():
    """An engine was built on the meta device, and its first token failed in torch ("Tensor on device cpu is not on
    the expected device meta!")."""
    with torch.device("meta"):
        empty = tiny_model()
    with pytest.raises(ValueError, match="on the meta device .* load its weights first"):
        Engine(empty)


def test_a_sliding_window_is_refused_only_where_a_layer_slides():
    """A Qwen2 whose max_window_layers covers every layer attends to the whole sequence in transformers (its
    layer_types are all full attention) but was refused for its sliding_window."""
    with pytest.raises(ValueError, match=r"exceeds the model's sliding window \(8\).*runs up to 8 positions"):
        Engine(tiny_model("mistral", sliding_window=8), max_seq_len=16)
    with pytest.raises(ValueError, match=r"max_seq_len=9 exceeds the model's sliding window \(8\)"):
        Engine(tiny_model("mistral", sliding_window=8), max_seq_len=9)  # one past the window
    assert Engine(tiny_model("mistral", sliding_window=8), max_seq_len=8).max_seq_len == 8
    assert Engine(tiny_model("mistral", sliding_window=8)).max_seq_len == 8  # Mistral v0.1: the window by default
    with pytest.raises(ValueError, match=r"exceeds the model's sliding window \(8\)"):
        Engine(tiny_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1), max_seq_len=16)
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert set(model.config.layer_types) == {"full_attention"}
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False)[:, 12:]
    assert torch.equal(Engine(model, max_seq_len=24).generate(ids, 6), want)


def test_top_k_or_top_p_without_a_temperature_warn_that_decoding_is_greedy():
    engine = Engine(tiny_model(initializer_range=0.2), max_seq_len=16)
    prompt = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(0))
    greedy = engine.generate(prompt, 4)
    for kwargs in (dict(top_k=5), dict(top_p=0.5)):
        with pytest.warns(UserWarning, match="with temperature 0 decoding is greedy"):
            assert torch.equal(engine.generate(prompt, 4, **kwargs), greedy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.generate(prompt, 4, temperature=1.0, top_k=5)
        engine.generate(prompt, 4)


def test_engine_warns_of_forward_hooks_its_own_forward_does_not_run():
    """A hook on q_proj, a norm or a decoder layer changes model(...) but not the engine's tokens: said once, at
    construction, naming them; hooks on modules the engine calls (o_proj, lm_head) and transformers' own
    output-recording hooks are not."""
    torch.manual_seed(0)
    model = tiny_model("llama")
    ids = torch.randint(3, 200, (1, 6))
    model(ids, output_hidden_states=True)  # transformers leaves its recording hooks on the decoder layers
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Engine(model, max_seq_len=32)
    model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda m, i, o: o)
    model.lm_head.register_forward_pre_hook(lambda m, i: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Engine(model, max_seq_len=32)
    model.model.layers[1].self_attn.q_proj.register_forward_hook(lambda m, i, o: o * 2)
    model.model.norm.register_forward_pre_hook(lambda m, i: None)
    with pytest.warns(UserWarning, match=r"forward hooks on model\.layers\.1\.self_attn\.q_proj, model\.norm do not "
                                         r"run in nibble\.Engine"):
        Engine(model, max_seq_len=32)


def test_hooks_on_fused_head_norms_are_warned_of():
    """Qwen3's q_norm and k_norm, both HF's RMSNorm, run inside the RoPE kernel, not as modules: a hook on either
    does not run (the test of head norms of other classes, whose hooks do, is in test_speed_memory)."""
    model = tiny_model("qwen3")
    model.model.layers[1].self_attn.k_norm.register_forward_hook(lambda m, i, o: o * 2)
    with pytest.warns(UserWarning, match=r"forward hooks on model\.layers\.1\.self_attn\.k_norm do not run in "
                                         r"nibble\.Engine"):
        Engine(model, max_seq_len=16)


def test_hooks_on_the_modules_the_engine_calls_are_not_warned_of():
    """The embedding, a SiLU MLP's down_proj and every module of an MLP it does not fuse (another activation) run in
    the engine's forward: their hooks run, unlike those it warns of. Past four hooked modules the warning counts the
    rest."""
    for act in ("silu", "gelu"):
        model = tiny_model(hidden_act=act)
        model.model.embed_tokens.register_forward_hook(lambda m, i, o: o)
        model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: o)
        if act == "gelu":
            model.model.layers[1].mlp.act_fn.register_forward_hook(lambda m, i, o: o)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Engine(model, max_seq_len=16)
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.register_forward_hook(lambda m, i, o: o)
    with pytest.warns(UserWarning, match=r"hooks on model\.layers\.0\.self_attn\.q_proj, model\.layers\.0\.self_attn"
                                         r"\.k_proj, model\.layers\.0\.self_attn\.v_proj, model\.layers\.1\.self_attn"
                                         r"\.q_proj and 2 more do not run"):
        Engine(model, max_seq_len=16)


# ---- logits that are not finite ----------------------------------------------------------------
# Where the token-picking kernels run in this process: CUDA, or Triton's interpreter on the CPU (None: PyTorch's ops)
KERNEL_DEVICE = ("cuda" if torch.cuda.is_available() else
                 "cpu" if os.environ.get("TRITON_INTERPRET") == "1" and engine_mod.triton is not None else None)


def _poison_a_token_made(model, prompts, made, steps, rows=None):
    """Set to NaN the embedding of a token that a sequence makes at one of ``steps`` (``made``: what each made after
    its prompt, unpoisoned) and that no sequence is fed otherwise (in its prompt, the pads' id 0, or the tokens any
    makes but the last): the logits of that sequence alone turn NaN, from the step that feeds it on. An untied
    lm_head keeps every logit of the token finite until then. Returns (sequence, that step), or None."""
    assert not model.config.tie_word_embeddings
    fed = {0} | {t for p in prompts for t in p.tolist()}
    for k in steps:
        for row in rows if rows is not None else range(len(made)):
            t = int(made[row, k])
            if t not in fed and not any(t in made[r, :k if r == row else -1].tolist() for r in range(len(made))):
                model.model.embed_tokens.weight.data[t] = torch.nan
                return row, k + 1
    return None


def _run(engine, prompts, n, sampled, **kwargs):
    torch.manual_seed(3)  # a sampled generation's draws repeat, poisoned or not, up to the poisoned step
    return engine.generate(prompts, n, **(dict(temperature=1.0) if sampled else {}), **kwargs)


def _check_a_poisoned_generation(model, device, sampled):
    """A poisoned token made at a later step in one sequence of a ragged batch: the generation raises naming the step
    that fed it and the sequence, greedy or sampled; the tokens before it are the unpoisoned ones (a stream hands them
    over, then raises); the engine goes on generating as before."""
    prompts = [p.to(device) for p in _ragged_prompts([9, 4, 6], seed=2)]
    engine = Engine(model, max_batch=3, max_seq_len=40)
    clean = _run(engine, prompts, 20, sampled)
    weights = model.model.embed_tokens.weight.detach().clone()
    found = _poison_a_token_made(model, prompts, clean, range(2, 18))
    assert found is not None, clean  # every token made fed elsewhere: another seed of the prompts
    row, step = found
    said = rf"^the model's logits held NaN or infinite values at decode step {step} \(new token {step + 1}\) " \
           rf"of sequence {row} of the batch: the tokens picked from them are garbage\. Likely causes: .*corrupt " \
           r"checkpoint"
    with pytest.raises(FloatingPointError, match=said):
        _run(engine, prompts, 20, sampled)
    chunks = []
    torch.manual_seed(3)
    with pytest.raises(FloatingPointError, match=said):
        for chunk in engine.stream(prompts, 20, **(dict(temperature=1.0) if sampled else {})):
            chunks.append(chunk)
    every = 1 if device == "cpu" else engine_mod.STOP_CHECK_STEPS
    handed = torch.cat(chunks, 1)
    assert handed.shape[1] == 1 + (step - 1) // every * every and torch.equal(handed, clean[:, :handed.shape[1]])
    assert torch.equal(_run(engine, prompts, step, sampled), clean[:, :step])  # up to the step that feeds it: no NaN
    model.model.embed_tokens.weight.data.copy_(weights)
    # as before: the NaN keys and values the poisoned runs left in the cache read by no later generation
    assert torch.equal(_run(engine, prompts, 20, sampled), clean)


@pytest.mark.parametrize("sampled", [False, True])
def test_nonfinite_logits_at_a_later_step_raise_naming_it(sampled):
    """Tokens picked from NaN logits came back without a word (greedy: torch.argmax's NaN index)."""
    _check_a_poisoned_generation(tiny_model(initializer_range=0.2, tie_word_embeddings=False), "cpu", sampled)


def test_nonfinite_logits_at_the_prefill_raise_naming_the_prefill():
    model = tiny_model(initializer_range=0.2, tie_word_embeddings=False)
    model.lm_head.weight.data[5, :3] = torch.inf  # every logit of token 5, at every position: the prefill's first
    engine = Engine(model, max_batch=2, max_seq_len=32)
    with pytest.raises(FloatingPointError, match=r"at the prefill \(the first new token's logits\) of sequence 0 of "
                                                 r"the batch \(and of 1 more\): .* or activations past float32's"):
        engine.generate(_ragged_prompts([5, 3]), 4)
    half = tiny_model(dtype=torch.float16, initializer_range=0.2)
    half.model.norm.weight.data[:] = 6e4  # float16 overflows: its hint is bfloat16; one sequence: none named
    with pytest.raises(FloatingPointError, match=r"^the model's logits held NaN or infinite values at the prefill "
                                                 r"\(the first new token's logits\): .* past float16's range "
                                                 r"\(65504\): load the model in bfloat16"):
        Engine(half, max_seq_len=32).generate(_ragged_prompts([5]), 4)


def test_nonfinite_logits_at_the_first_decode_step_name_it_and_a_bfloat16_models_hint_is_its_own():
    """Decode step 1 (fed the prefill's token) was said as the prefill; a bfloat16 model was given float16's hint."""
    model = tiny_model(initializer_range=0.2, tie_word_embeddings=False)
    prompts = _ragged_prompts([6, 4], seed=5)
    engine = Engine(model, max_batch=2, max_seq_len=32)
    row, step = _poison_a_token_made(model, prompts, engine.generate(prompts, 4), [0])
    with pytest.raises(FloatingPointError, match=rf"at decode step 1 \(new token 2\) of sequence {row} of the batch"):
        engine.generate(prompts, 4)
    said = str(engine_mod.nonfinite_logits_error(3, 0, 0, 1, torch.bfloat16))
    assert "or activations past bfloat16's range" in said and "65504" not in said


def test_nonfinite_logits_past_a_sequences_stop_token_raise_nothing():
    """A sequence that stopped runs on while the others do: what its later logits pick is not its answer (it
    repeats its stop token), but the step that picked its stop token counts."""
    model = tiny_model(initializer_range=0.2, tie_word_embeddings=False)
    prompts = _ragged_prompts([7, 5], seed=3)
    engine = Engine(model, max_batch=2, max_seq_len=40)
    clean = engine.generate(prompts, 16)
    stop = int(clean[0, 2])
    assert stop not in clean[0, :2].tolist() + clean[1].tolist()  # sequence 0 stops at step 2, sequence 1 never
    row, step = _poison_a_token_made(model, prompts, clean, range(3, 14), rows=[0])
    assert engine.generate(prompts, 16, stop_tokens=stop).equal(past_stop(clean, {stop}))
    with pytest.raises(FloatingPointError, match=rf"decode step {step} .* of sequence 0 of the batch:"):
        engine.generate(prompts, 16)
    # its NaN logits pick token 0 (torch.argmax's first NaN): as a stop token, the step that picked it counts
    assert 0 not in clean[0, :step].tolist()
    with pytest.raises(FloatingPointError, match=rf"decode step {step} .* of sequence 0 of the batch:"):
        engine.generate(prompts, 16, stop_tokens=0)


def test_nonfinite_logits_from_the_step_after_a_sequences_stop_token_raise_nothing():
    """Its stop token fed back with a NaN embedding: the logits of the very next step, the first past its answer, are
    NaN (counted as its answer's, a generation raised); they pick token 0 (argmax's first NaN), which as a stop token
    too is a second stop of that sequence (whose step counted in place of the first)."""
    model = tiny_model(initializer_range=0.2, tie_word_embeddings=False)
    prompts = _ragged_prompts([7, 5], seed=4)
    engine = Engine(model, max_batch=2, max_seq_len=40)
    clean = engine.generate(prompts, 16)
    stop = int(clean[0, 2])
    assert 0 not in clean.tolist()[0][:3] + clean.tolist()[1] and stop not in clean.tolist()[1]
    assert _poison_a_token_made(model, prompts, clean, [2], rows=[0]) == (0, 3)  # the stop token's embedding
    for stops in ({stop}, {stop, 0}):
        assert torch.equal(engine.generate(prompts, 16, stop_tokens=stops), past_stop(clean, stops))


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(0.8, top_p=0.9), Sampling(0.8, top_k=5),
                                      Sampling(1.5, top_k=150)], ids=["greedy", "top_p", "top_k_in_the_launches",
                                                                      "top_k_by_torch"])
def test_nonfinite_logits_are_recorded_where_the_token_is_picked_without_changing_it(sampling, monkeypatch):
    """`next_tokens`' watch: the earliest position of each row whose logits held a NaN or +-inf, on the device, in
    the kernels' one read of the logits (here: where they run), the tokens the same as unwatched. Rows of several
    chunks and blocks, a masked tail, strided rows; a row's earlier record kept where it is earlier."""
    device = KERNEL_DEVICE or "cpu"
    monkeypatch.setattr(engine_mod, "SAMPLE_CHUNK", 256)
    monkeypatch.setattr(engine_mod, "SAMPLE_BLOCK", 64)
    V = 3 * 256 - 37
    g = torch.Generator().manual_seed(8)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(6, V + 3, generator=g) * 3
        x[1, 600] = torch.nan  # in the third chunk
        x[2, V] = torch.inf  # the last entry, past a chunk's full blocks
        x[3, 1] = -torch.inf  # the first logit
        x[4, 300], x[4, 301] = torch.inf, torch.nan
        x[5, 17] = torch.nan  # already recorded earlier: kept
        logits = x.to(dtype).to(device)[:, 1:V + 1]  # rows V + 3 apart: x[2, V] is the row's last logit
        first = torch.tensor([2 ** 31 - 1] * 5 + [3], dtype=torch.int32, device=device)
        at = torch.arange(10, 16, device=device)
        torch.manual_seed(0)
        unwatched = engine_mod.next_tokens(logits, sampling)
        torch.manual_seed(0)
        watched = engine_mod.next_tokens(logits, sampling, (first, at))
        assert torch.equal(watched, unwatched)
        assert first.tolist() == [2 ** 31 - 1, 11, 12, 13, 14, 3], (dtype, first)
        assert engine_mod._glue_failure is None


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("sampled", [False, True])
def test_cuda_graph_engine_raises_on_nonfinite_logits(sampled):
    """The graphs record into the engine's static buffer; the capture's warm-ups (two steps, the second one the
    generation may never take) record nothing."""
    model = tiny_model(dtype=torch.bfloat16, initializer_range=0.2, tie_word_embeddings=False).cuda()
    _check_a_poisoned_generation(model, "cuda", sampled)
    for seed in range(20):  # a token made at step 1, fed by step 2: the second warm-up of the first decode's capture
        model = tiny_model(dtype=torch.bfloat16, initializer_range=0.2, tie_word_embeddings=False).cuda()
        prompts = [p.cuda() for p in _ragged_prompts([6, 3], seed=seed)]
        clean = _run(Engine(model, max_batch=2, max_seq_len=32), prompts, 4, sampled)
        if _poison_a_token_made(model, prompts, clean, [1]) is not None:
            break
    else:
        pytest.fail("no seed made a token at step 1 that no sequence is fed otherwise")
    engine = Engine(model, max_batch=2, max_seq_len=32)
    assert torch.equal(_run(engine, prompts, 2, sampled), clean[:, :2])  # prefill + step 1, whose capture ran step 2
    assert ("decode", 2) in engine._graphs or ("decode", 2, Sampling(1.0)) in engine._graphs
    with pytest.raises(FloatingPointError, match=r"at decode step 2 \(new token 3\)"):
        _run(engine, prompts, 4, sampled)


def test_nonfinite_logits_are_recorded_by_the_kernels_under_the_triton_interpreter():
    """The kernels' watch on the CPU: the test above once more, under Triton's interpreter (where the kernels run in
    this process already, it ran them). Its top-k in the launches, and the engine's tests above, take a minute each
    there: TRITON_INTERPRET=1 pytest -k nonfinite runs them."""
    if KERNEL_DEVICE is not None or engine_mod.triton is None:
        pytest.skip("the kernels ran in this process (CUDA, or the interpreter), or triton is missing")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::"
                        "test_nonfinite_logits_are_recorded_where_the_token_is_picked_without_changing_it", "-k",
                        "not in_the_launches"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "3 passed, 1 deselected" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]

import copy
import dataclasses

import pytest
import torch

from toolcollapse.chat import generation_prompt, message_pieces, turn_suffix
from toolcollapse.records import Message
from toolcollapse.kvcache import drop_unread_groups, take_rows
from toolcollapse.rollout import RolloutEngine, SamplingParams, draw, sample_next


@pytest.fixture(scope="module")
def policy(tiny_model, tokenizer):
    """The random tiny model with a logit bias towards <tool_call> and </tool_call>, so turns open and
    end calls and episodes run several turns (7-13 of 24 in the fixture, whatever the seed): tool errors
    come back, get appended."""
    model = copy.deepcopy(tiny_model)
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.get_output_embeddings().weight)
        head.bias.zero_()
        head.bias[tokenizer.convert_tokens_to_ids("</tool_call>")] = 4.0
        head.bias[tokenizer.convert_tokens_to_ids("<tool_call>")] = 4.0
    model.lm_head = head
    return model.eval()


@pytest.fixture(scope="module")
def engine(policy, tokenizer, world):
    return RolloutEngine(policy, tokenizer, world)


@pytest.fixture(scope="module")
def episodes(engine, world):
    tasks = world.tasks("test")[:4] + world.tasks("ood_format")[:4]  # prompts of different lengths
    params = SamplingParams(max_turns=4, max_new_tokens=40, batch_size=12)
    return tasks, engine.generate(tasks, params, group_size=3, seed=7)


def test_groups_in_task_order(episodes):
    tasks, eps = episodes
    assert [e.task_id for e in eps] == [t.id for t in tasks for _ in range(3)]
    for i in range(0, len(eps), 3):
        p = eps[i].prompt_len
        assert eps[i].tokens[:p] == eps[i + 1].tokens[:p] == eps[i + 2].tokens[:p]


def test_loss_mask_is_exactly_the_sampled_turns(episodes):
    _, eps = episodes
    for ep in eps:
        assert len(ep.tokens) == len(ep.loss_mask) == len(ep.logprobs)
        sampled = {i for t in ep.turns for i in range(t.start, t.end)}
        assert {i for i, m in enumerate(ep.loss_mask) if m} == sampled
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if not m)
        assert all(t.end - t.start <= 40 for t in ep.turns) and len(ep.turns) <= 4


def test_observations_are_appended_token_in_token_out(engine, episodes):
    _, eps = episodes
    multi = [ep for ep in eps if len(ep.turns) > 1]
    assert multi, "the seed should give some multi-turn episodes"
    for ep in multi:
        for turn, nxt in zip(ep.turns, ep.turns[1:]):
            assert turn.parsed.end == "call" and turn.observation is not None
            expected, _ = engine.encoder.encode(turn_suffix(True) + message_pieces(Message("tool", turn.observation))
                                                + generation_prompt())
            assert ep.tokens[turn.end:nxt.start] == expected


def test_recorded_logprobs_match_a_plain_forward(policy, episodes):
    """KV cache, padding holes and positions leave each sequence exactly as an unpadded forward sees it."""
    _, eps = episodes
    for ep in eps[::2]:
        ids = torch.tensor([ep.tokens])
        with torch.no_grad():
            logp = torch.log_softmax(policy(input_ids=ids).logits[0].float(), dim=-1)  # [T, V]
        pos = [i for i, m in enumerate(ep.loss_mask) if m]
        recomputed = logp[torch.tensor(pos) - 1, torch.tensor([ep.tokens[i] for i in pos])]
        torch.testing.assert_close(recomputed, torch.tensor([ep.logprobs[i] for i in pos]), atol=2e-4, rtol=0)


def test_same_seed_same_rollouts(engine, world, episodes):
    tasks, eps = episodes
    again = engine.generate(tasks, SamplingParams(max_turns=4, max_new_tokens=40, batch_size=12), 3, seed=7)
    assert [e.tokens for e in again] == [e.tokens for e in eps]
    other = engine.generate(tasks, SamplingParams(max_turns=4, max_new_tokens=40, batch_size=12), 3, seed=8)
    assert [e.tokens for e in other] != [e.tokens for e in eps]


def test_turn_and_context_caps(engine, world):
    tasks = world.tasks("test")[:3]
    eps = engine.generate(tasks, SamplingParams(max_turns=1, max_new_tokens=5, batch_size=8), group_size=2)
    for ep in eps:
        assert len(ep.turns) == 1 and ep.turns[0].end - ep.turns[0].start <= 5
        assert ep.finish in ("malformed", "max_turns", "answered")
    limit = max(len(e.tokens) for e in eps[:1]) + 2
    capped = engine.generate(tasks[:1], SamplingParams(max_turns=3, max_new_tokens=50, max_seq_len=limit))
    assert len(capped[0].tokens) <= limit and capped[0].finish in ("context_limit", "answered", "malformed")


def test_greedy_sampling_and_top_p():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    tok, lp = sample_next(logits, SamplingParams(greedy=True), None)
    assert tok.tolist() == [1, 0]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1))
    tok, lp = sample_next(logits.repeat(200, 1), SamplingParams(top_p=0.5), torch.rand(400, dtype=torch.float64))
    assert set(tok[0::2].tolist()) == {1} and set(tok[1::2].tolist()) == {0}  # only the top token survives
    assert torch.allclose(lp, torch.zeros_like(lp))  # renormalised: log 1


def test_draw_follows_the_probabilities_and_never_draws_a_zero():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0], [0.0, 0.0, 0.0, 2.0, 0.0]])  # the second row unnormalised
    g = torch.Generator().manual_seed(0)
    tokens = draw(probs.repeat(20_000, 1), torch.rand(40_000, generator=g, dtype=torch.float64)).view(20_000, 2)
    freq = torch.bincount(tokens[:, 0], minlength=5) / 20_000
    torch.testing.assert_close(freq, probs[0], atol=0.012, rtol=0)  # 4 standard errors at p = 0.5
    assert set(tokens[:, 1].tolist()) == {3}


def test_draw_refuses_a_distribution_that_is_not_one():
    with pytest.raises(ValueError, match="rows \\[1\\] is NaN, infinite or all zero"):
        draw(torch.tensor([[0.5, 0.5], [float("nan"), 0.5]]), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="rows \\[0\\]"):
        draw(torch.zeros(1, 3), torch.zeros(1, dtype=torch.float64))


def test_draw_at_the_top_of_the_cdf_keeps_to_possible_tokens():
    """u * total can round up to the total; searchsorted then points past the last token of probability > 0."""
    assert draw(torch.tensor([[0.2, 0.8, 0.0, 0.0]]), torch.ones(1, dtype=torch.float64)).tolist() == [1]


class Scripted(torch.nn.Module):
    """A policy that writes a fixed token script: every forward forces the script's next token, and a
    one-token input equal to the token it forced advances it. Greedy, one sequence at a time."""

    def __init__(self, inner, script: list[int]):
        super().__init__()
        self.inner, self.config, self.script, self.i = inner, inner.config, script, 0

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                logits_to_keep=0):
        from toolcollapse.model import forward

        out = forward(self.inner, input_ids, attention_mask, position_ids, past_key_values, logits_to_keep)
        if position_ids is None:  # (the engine runs a shared prefix alone from position 0)
            position_ids = torch.arange(input_ids.shape[1])[None]
        if input_ids.shape[1] == 1 and self.i < len(self.script) and int(input_ids[0, -1]) == self.script[self.i]:
            self.i += 1
        forced = torch.full_like(out.logits, -1e9)
        forced[:, -1, self.script[min(self.i, len(self.script) - 1)]] = 0.0
        out.logits = forced
        return out


@pytest.mark.parametrize("call_end", ["template", "sampled"])
def test_an_oracle_policy_rolls_out_exactly_the_sft_tokens(tiny_model, tokenizer, world, call_end):
    """Token-in/token-out in both call_end modes: a policy writing the reference turns produces the
    conversation SFT trains on, with the loss mask on exactly the trainable tokens -- with `sampled`,
    the <|im_end|> after each </tool_call> is the policy's (mask 1), with `template` the pipeline's (0)."""
    from toolcollapse.chat import PieceEncoder, assistant_body

    encoder = PieceEncoder(tokenizer)
    task = world.tasks("test")[0]
    script = [t for m in task.reference if m.role == "assistant" for t in encoder.encode(assistant_body(m, call_end))[0]]
    engine = RolloutEngine(Scripted(tiny_model, script), tokenizer, world, call_end)
    [ep] = engine.generate([task], SamplingParams(max_turns=10, max_new_tokens=96, greedy=True))
    ids, mask = engine.encoder.encode_conversation(list(task.prompt) + list(task.reference))
    assert engine.call_end == engine.encoder.call_end == call_end
    assert ep.tokens == ids[:len(ep.tokens)] and len(ids) - len(ep.tokens) == 1  # all but the final "\n"
    assert ep.loss_mask == mask[:len(ep.tokens)]
    assert ep.finish == "answered" and ep.success and all(t.parsed.state.healthy for t in ep.turns)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    after_calls = [ep.loss_mask[t.end - 1] for t in ep.turns if t.parsed.end == "call"
                   if ep.tokens[t.end - 1] == im_end]
    assert len(after_calls) == (sum(m.tool_call is not None for m in task.reference) if call_end == "sampled" else 0)


class StopsSometimes(torch.nn.Module):
    """A greedy policy whose turns are calls of varied lengths, decided by its history alone: it opens
    each turn with <tool_call>, then writes the inner model's choice among non-stop tokens, or
    </tool_call> where token id + position is a multiple of 9."""

    def __init__(self, inner, stops: list[int], turn_start: int, open_call: int):
        super().__init__()
        self.inner, self.config, self.stops = inner, inner.config, stops
        self.turn_start, self.open_call = turn_start, open_call  # last token of "<|im_start|>assistant\n"

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                logits_to_keep=0, **kwargs):
        from toolcollapse.model import forward

        out = forward(self.inner, input_ids, attention_mask, position_ids, past_key_values, logits_to_keep)
        if position_ids is None:  # (the engine runs a shared prefix alone from position 0)
            position_ids = torch.arange(input_ids.shape[1])[None]
        logits = out.logits.clone()
        logits[:, -1, self.stops] = -1e9
        stop_here = (input_ids[:, -1] + position_ids[:, -1]) % 9 == 0
        logits[stop_here, -1, self.stops[0]] = 1e9
        logits[input_ids[:, -1] == self.turn_start, -1, self.open_call] = 2e9
        out.logits = logits
        return out


def test_shared_prefix_attention_and_row_compaction_change_no_greedy_episode(tiny_model, tokenizer, world):
    """The engine's two speed-ups (the batch's shared prefix attended once, rows whose turn ended leaving the
    batch) are exact: in groups, on prompts that share the system prompt (test) and on prompts in four
    renderings (ood_format, whose shared prefix is shorter), with turns that end at different times, each
    row's greedy episode is the one it gets decoded alone. (The engine before them: bench/behaviour_vs_rev.py.)"""
    from toolcollapse.chat import PieceEncoder

    stops = [tokenizer.convert_tokens_to_ids(t) for t in ("</tool_call>", "<|im_end|>")]
    turn_start = PieceEncoder(tokenizer).encode(generation_prompt())[0][-1]
    model = StopsSometimes(tiny_model, stops, turn_start, tokenizer.convert_tokens_to_ids("<tool_call>")).eval()
    tasks = world.tasks("test")[:3] + world.tasks("ood_format")[:3]
    params = SamplingParams(max_turns=3, max_new_tokens=30, greedy=True, batch_size=12)
    engine = RolloutEngine(model, tokenizer, world)
    before = [ep for t in tasks for ep in engine.generate([t], params, group_size=1) * 2]  # each row alone
    now = engine.generate(tasks, params, group_size=2)
    assert [e.tokens for e in now] == [e.tokens for e in before]
    assert [e.loss_mask for e in now] == [e.loss_mask for e in before]
    torch.testing.assert_close(torch.tensor([x for e in now for x in e.logprobs]),
                               torch.tensor([x for e in before for x in e.logprobs]), atol=1e-4, rtol=0)
    lengths = {t.end - t.start for e in now for t in e.turns}
    assert len(lengths) > 3 and max(len(e.turns) for e in now) > 1  # rows left the batch; turns were appended


def test_a_prompts_rows_sharing_one_copy_of_its_rest_change_no_episode(tiny_model, policy, tokenizer, world,
                                                                       monkeypatch):
    """A prompt's rest kept once for its G rows (on BFCL each task's own system prompt, each prompt's rest
    prefilled alone): the same greedy episodes, rows leaving the batch and coming back, and the same sampled
    ones as a copy per row. The tool world's questions are under the length where it pays
    (`RolloutEngine.min_group_shared`), so it is lowered; raised past any prompt, each row has its copy."""
    from toolcollapse import rollout
    from toolcollapse.chat import PieceEncoder

    shared, parked, groups_left = [], [], []

    def drop(cache):
        before = len(cache.layers[0].groups.mask) if cache.layers[0].groups is not None else 0
        drop_unread_groups(cache)
        if before:
            groups_left.append((before, len(cache.layers[0].groups.mask)))

    monkeypatch.setattr(rollout, "drop_unread_groups", drop)
    groups = RolloutEngine._prefill_groups
    monkeypatch.setattr(RolloutEngine, "_prefill_groups", lambda *a: shared.append(1) or groups(*a))
    monkeypatch.setattr(rollout, "take_rows", lambda *a: parked.append(1) or take_rows(*a))
    stops = [tokenizer.convert_tokens_to_ids(t) for t in ("</tool_call>", "<|im_end|>")]
    turn_start = PieceEncoder(tokenizer).encode(generation_prompt())[0][-1]
    greedy = StopsSometimes(tiny_model, stops, turn_start, tokenizer.convert_tokens_to_ids("<tool_call>")).eval()
    tasks = world.tasks("test")[:6]
    for model, params in ((greedy, SamplingParams(max_turns=3, max_new_tokens=30, greedy=True, batch_size=12)),
                          (policy, SamplingParams(max_turns=4, max_new_tokens=40, batch_size=12))):
        engine = RolloutEngine(model, tokenizer, world)
        engine.min_group_shared = 10 ** 9
        off = engine.generate(tasks, params, 3, seed=5)
        parked.clear()
        engine.min_group_shared = 1
        on = engine.generate(tasks, params, 3, seed=5)
        if params.greedy:
            assert parked  # rows whose turn had ended left the batch and came back with their groups
        assert [e.tokens for e in on] == [e.tokens for e in off]
        torch.testing.assert_close(torch.tensor([x for e in on for x in e.logprobs]),
                                   torch.tensor([x for e in off for x in e.logprobs]), atol=1e-4, rtol=0)
    assert len(shared) == 2 * 2  # both batches (4 tasks x 3, 2 x 3) of both `on` runs shared
    assert any(after < before for before, after in groups_left), groups_left  # a task's rollouts all ended


def test_rows_that_repeat_a_prompt_in_any_order_prefill_it_once(policy, tokenizer, world, monkeypatch):
    """Rows that repeat a prompt, in any order (HBG's batch: each task's rows and its hinted copies,
    group_size 1), prefill each distinct prompt once, left-padded together or, with the engine's
    `min_group_shared` lowered, kept once as the group parts its rows read; both sample the same episodes,
    each row's what it samples decoded alone (its own random stream, its index in the call)."""
    a, b, c = world.tasks("test")[:3]
    tasks = [a, b, a, c, a, b]
    params = SamplingParams(max_turns=4, max_new_tokens=40, batch_size=12)
    prefilled = []  # rows of each generate's first forward (its prefill), or prompts prefilled alone
    forward, groups = RolloutEngine._forward, RolloutEngine._prefill_groups
    monkeypatch.setattr(RolloutEngine, "_forward", lambda self, ids, *a: prefilled.append(len(ids)) or forward(self, ids, *a))
    monkeypatch.setattr(RolloutEngine, "_prefill_groups", lambda self, c, p, rests, *a: prefilled.append(-len(rests))
                        or groups(self, c, p, rests, *a))
    engine = RolloutEngine(policy, tokenizer, world)
    runs = []
    for min_shared in (engine.min_group_shared, 1):
        engine.min_group_shared = min_shared
        prefilled.clear()
        runs.append((engine.generate(tasks, params, seed=3), prefilled[0]))
    (padded, rows_padded), (grouped, rows_grouped) = runs
    assert rows_padded == 3 and rows_grouped == -3  # 3 distinct prompts, prefilled once each
    alone = engine.generate(tasks, dataclasses.replace(params, batch_size=1), seed=3)  # a batch a row
    for on in (grouped, alone):
        assert [e.tokens for e in on] == [e.tokens for e in padded]
        torch.testing.assert_close(torch.tensor([x for e in on for x in e.logprobs]),
                                   torch.tensor([x for e in padded for x in e.logprobs]), atol=1e-4, rtol=0)
    assert len({tuple(e.tokens) for e in padded}) > 3  # the repeats sampled apart


def test_a_prefix_cache_runs_the_system_prompt_once_for_a_steps_rollouts_probe_and_validation(
        policy, tokenizer, world, monkeypatch):
    """`rl`'s step: the rollouts, the probe and validation start with the same system prompt; with the
    engine's PrefixCache it is run once until cleared, and every reader gets the numbers it would have run."""
    from toolcollapse import model as model_module
    from toolcollapse.chat import CONTROL_TAGS, PieceEncoder
    from toolcollapse.model import PrefixCache
    from toolcollapse.monitor import build_probe, content_labels, resolve_token_ids, run_probe
    from toolcollapse.encoding import encode_tasks

    encoder = PieceEncoder(tokenizer)
    probe_tasks = world.tasks("train")[:4]
    probe = build_probe(encode_tasks(encoder, probe_tasks), tokenizer.pad_token_id,
                        resolve_token_ids(tokenizer, CONTROL_TAGS),
                        [content_labels(encoder, [*t.prompt, *t.reference]) for t in probe_tasks])
    ids = resolve_token_ids(tokenizer, CONTROL_TAGS)
    tasks = world.tasks("test")[:3]
    sampled, greedy = (SamplingParams(max_turns=3, max_new_tokens=24, batch_size=12, greedy=g) for g in (False, True))

    def step(engine, prefixes):
        return (engine.generate(tasks, sampled, group_size=2, seed=5), run_probe(policy, probe, ids, 1.0, prefixes),
                engine.generate(tasks, greedy, seed=5))

    plain = step(RolloutEngine(policy, tokenizer, world), None)
    runs = []
    real = model_module.prompt_prefix  # what every PrefixCache runs, a reader's own too
    monkeypatch.setattr(model_module, "prompt_prefix", lambda *a: runs.append(1) or real(*a))
    engine = RolloutEngine(policy, tokenizer, world)
    engine.prefixes = PrefixCache(policy)
    shared = step(engine, engine.prefixes)
    assert runs == [1]  # the first rollout ran it; the probe and validation read it
    for got, want in ((shared[0], plain[0]), (shared[2], plain[2])):
        assert [e.tokens for e in got] == [e.tokens for e in want] and [e.logprobs for e in got] == [e.logprobs for e in want]
    assert shared[1] == plain[1]
    engine.prefixes.clear()  # the weights moved
    engine.generate(tasks[:1], greedy)
    assert runs == [1, 1]


def test_a_sampled_episode_does_not_depend_on_its_batch(engine, policy, tokenizer, world, episodes):
    """Each sequence draws from its own stream: the same sampled episodes in batches of 12, of 5, and of one
    task's group (3 rows: too few to leave the batch, so no row compaction)."""
    tasks, eps = episodes
    small = engine.generate(tasks, SamplingParams(max_turns=4, max_new_tokens=40, batch_size=5), 3, seed=7)
    one = engine.generate(tasks, SamplingParams(max_turns=4, max_new_tokens=40, batch_size=1), 3, seed=7)
    assert [e.tokens for e in small] == [e.tokens for e in eps] == [e.tokens for e in one]
    assert len({tuple(e.tokens) for e in eps[:3]}) > 1  # a group's rows do sample apart


def test_lean_decode_gives_the_models_own_numbers_bit_for_bit(policy, tokenizer, world, episodes, monkeypatch):
    """Decoding steps of a Llama model skip Hugging Face's wrappers (`rollout.lean_decode`): the same
    sampled episodes and the same log-probs to the last bit as through model(...), and the lean path
    did run (every decoding step of the batch went through it)."""
    from toolcollapse import rollout

    tasks, eps = episodes
    calls = []
    lean = rollout.lean_decode
    monkeypatch.setattr(rollout, "lean_decode", lambda *args: calls.append(1) or lean(*args))
    params = SamplingParams(max_turns=4, max_new_tokens=40, batch_size=12)
    on = RolloutEngine(policy, tokenizer, world).generate(tasks, params, 3, seed=7)
    lean_steps = len(calls)
    engine = RolloutEngine(policy, tokenizer, world)
    engine.lean_decoding = False
    off = engine.generate(tasks, params, 3, seed=7)
    assert lean_steps > 40 and len(calls) == lean_steps  # every decoding step of `on`, none of `off`
    assert [e.tokens for e in on] == [e.tokens for e in off] == [e.tokens for e in eps]
    assert [x for e in on for x in e.logprobs] == [x for e in off for x in e.logprobs]


def test_lean_decode_leaves_hooked_and_subclassed_models_to_their_own_forward(policy):
    """A forward hook (a user's, accelerate's device placement) or a subclass's own forward would be
    skipped by the lean step: such models decode through model(...)."""
    from transformers import LlamaForCausalLM

    from toolcollapse.rollout import lean_decode_applies

    assert lean_decode_applies(policy)
    model = copy.deepcopy(policy)
    handle = model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out)
    assert not lean_decode_applies(model)
    handle.remove()
    assert lean_decode_applies(model)
    model.__class__ = type("MyLlama", (LlamaForCausalLM,), {})
    assert not lean_decode_applies(model)

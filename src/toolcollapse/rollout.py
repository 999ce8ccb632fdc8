"""Batched, KV-cached, multi-turn rollouts, token-in/token-out.

For a batch of tasks and G rollouts each:
  1. encode each prompt, prefill each distinct one once (left-padded together), then
     copy its KV cache to its rows -- a group's G rows, or a task's rows and HBG's hinted
     copies of it in one batch of any order: every distinct prompt is computed once;
  2. decode one assistant turn for every live sequence in lock-step; a sequence
     stops on </tool_call> (unless `call_end="sampled"`: then the policy goes on to
     write the call turn's <|im_end|>), <|im_end|>, <|endoftext|> or its per-turn
     budget, then feeds pad tokens (masked out) until the others are done;
  3. parse each turn (four states), let the environment answer it (run the tool);
  4. append, per sequence, the template tokens and the observation's tokens to the
     KV cache in one left-padded chunk -- the history is never decoded and
     re-encoded (re-tokenisation caused silent training bugs in TRL and verl);
  5. drop finished sequences from the cache and repeat until none is left.

Padding inside the cache is masked, and positions count real tokens only, so each
sequence sees exactly what an unpadded forward over `Episode.tokens` would see.

The prefix every prompt of the batch shares -- the system prompt -- is run once and its keys and
values are kept once: each decoding step attends to them for all rows in one product (`attention.py`,
`kvcache.CascadeLayer`) instead of through a copy per row; the rest of each row is cached per row. Where
the prompts' rests are long (`min_group_shared`), the G rows of a prompt also read one copy of it
instead of G (on BFCL each task has its own 2-5 k-token system prompt, of which a batch shares ~200).
Exact: each row's episode is the one it gets decoded alone (greedy: identical tokens; tested; the
paths before, a copy per row, are compared in `bench/behaviour_vs_rev.py` against b6b1319).
The sampling log-prob of every sampled token is recorded (under the distribution it
was sampled from: temperature and top-p applied), and `loss_mask` is 1 only there.
Same seed -> same rollouts. Every sequence draws its tokens from its own random stream (seeded by
the call's seed and the sequence's index in it), one uniform number per sampled token, by inverting
the CDF: a sequence's samples do not depend on which others share its batch, on rows leaving the
batch, nor on the device (the draws are made on the CPU).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers import DynamicCache, LlamaForCausalLM, PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from toolcollapse.chat import (ENDOFTEXT, CONTROL_TAGS, PieceEncoder, assistant_body, conversation_pieces,
                               generation_prompt, message_pieces, stop_tags, turn_suffix)
from toolcollapse.attention import cascade, cascade_attention, causal_mask
from toolcollapse.config import RolloutConfig
from toolcollapse.envs.base import Environment, EpisodeState
from toolcollapse.kvcache import (add_rows, append_only_cache, cascade_cache, drop_unread_groups, take_rows)
from toolcollapse.model import PrefixCache, device_of, forward, precision
from toolcollapse.parser import parse_turn_ids
from toolcollapse.records import CallEnd, Episode, Task, TurnRecord
from toolcollapse.runtime import progress




def lean_decode(model: LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                cache: DynamicCache) -> torch.Tensor:
    """Next-token logits [N, V] for one new token a row (ids, pos [N, 1]; mask [N, 1, 1, L]) of a
    Llama model with a cascade cache: `LlamaForCausalLM.forward` as its modules and functions run it,
    in the same order -- so the same numbers, bit for bit (test) -- without the wrappers around them
    (keyword plumbing, output capture, mask building, output classes): on the tiny tier ~1 ms of a
    ~6 ms step (docs/BENCHMARKS.md). Other models take model(...) (`lean_decode_applies`)."""
    decoder = model.model
    h = decoder.embed_tokens(ids)
    cos, sin = decoder.rotary_emb(h, position_ids=pos)
    for i, layer in enumerate(decoder.layers[:model.config.num_hidden_layers]):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        shape = (*x.shape[:-1], -1, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)
        k = attn.k_proj(x).view(shape).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = cache.layers[i].update(k, v)
        out, _ = cascade_attention(attn, q, k, v, mask, dropout=attn.attention_dropout if attn.training else 0.0,
                                   scaling=attn.scaling)
        h = h + attn.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(decoder.norm(h)[:, -1])


def lean_decode_applies(model: Any) -> bool:
    """`lean_decode` may run `model`'s decoding steps: a LlamaForCausalLM itself (a subclass may override
    forward; a PEFT model is another class) whose modules carry no forward hooks (a user's, accelerate's
    device hooks), which the lean step would skip."""
    return type(model) is LlamaForCausalLM and not any(
        m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in model.modules())


@dataclass(frozen=True)
class SamplingParams:
    max_turns: int = 10
    max_new_tokens: int = 96  # per assistant turn
    max_seq_len: int = 2048  # a sequence reaching it ends with finish="context_limit"
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    batch_size: int = 64  # sequences decoded together


def sample_next(logits: torch.Tensor, params: SamplingParams,
                uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens and their log-probs under the sampling distribution. logits: [N, V]; uniforms [N]
    in [0, 1), one a row (not read when greedy)."""
    logits = logits.float()
    if params.greedy:
        logp = torch.log_softmax(logits, dim=-1)  # [N, V]
        tokens = logits.argmax(dim=-1)  # [N]
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
    logp = torch.log_softmax(logits / params.temperature, dim=-1)  # [N, V]
    if params.top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        cum = sorted_logp.exp().cumsum(dim=-1)
        drop = cum - sorted_logp.exp() > params.top_p  # keep the smallest prefix with mass >= top_p
        sorted_logp = sorted_logp.masked_fill(drop, float("-inf"))
        logp = torch.full_like(logp, float("-inf")).scatter(1, order, sorted_logp)
        logp = torch.log_softmax(logp, dim=-1)
    tokens = draw(logp.exp(), uniforms)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token a row [N] from probabilities [N, V] (rows need not sum to 1), by inverting the CDF at
    the row's uniform number in [0, 1) [N]. (`torch.multinomial` on the CPU draws V exponentials a row
    from one generator: 0.8 ms a call at 32 x 1929, 7 % of a rollout.) A token of probability 0 is
    never drawn."""
    cdf = probs.double().cumsum(dim=-1)  # [N, V]
    total = cdf[:, -1]
    bad = ~torch.isfinite(total) | (total <= 0)
    if bad.any():
        raise ValueError(f"sampling distribution of rows {bad.nonzero()[:, 0].tolist()[:5]} is NaN, infinite or all "
                         "zero: the model's logits are not finite (diverged weights?)")
    u = uniforms.to(cdf)[:, None] * total[:, None]
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)  # CDF first > u
    stuck = probs.gather(1, tokens[:, None]).squeeze(1) <= 0  # u rounded up to the total: past the last possible
    if stuck.any():  # (rare: only then the extra pass over the vocabulary)
        last = probs.shape[1] - 1 - (probs > 0).flip(dims=[1]).int().argmax(dim=1)
        tokens = torch.where(stuck, last, tokens)
    return tokens


def row_stream(seed: int, row: int) -> random.Random:
    """The random stream of row `row` of a `generate` call with `seed` (distinct for every pair)."""
    return random.Random(f"toolcollapse-rollout:{seed}:{row}")


@dataclass
class _Row:
    """A live sequence: its episode record, its environment state, its turn in progress."""

    episode: Episode
    state: EpisodeState
    turn_ids: list[int] = field(default_factory=list)
    generating: bool = True
    rng: random.Random | None = None  # its random stream, one number per sampled token (None: replayed)


class RolloutEngine:
    def __init__(self, model: PreTrainedModel, tokenizer: Any, env: Environment, call_end: CallEnd = "template"):
        self.model = model
        self.tokenizer = tokenizer
        self.env = env
        # a prompt's G rows read one copy of its rest past the batch's prefix where the rests average this
        # many tokens (tests lower it to reach that path with the tool world's short questions)
        self.min_group_shared = MIN_GROUP_SHARED
        # decoding steps of Llama models skip Hugging Face's wrappers (`lean_decode`); False: model(...), the
        # numbers lean_decode must equal to the last bit (tests and bench/gpu_check.py compare them)
        self.lean_decoding = True
        self.encoder = PieceEncoder(tokenizer, call_end)
        ids = self.encoder.special_ids
        self.stop_ids = frozenset(ids[t] for t in stop_tags(call_end))
        self.pad_id = ids[ENDOFTEXT]
        self.id_to_tag = {ids[t]: t for t in CONTROL_TAGS}
        self.device = device_of(model)  # ids, masks and the cache live there; sampling draws on the CPU
        self.lean = False  # decoding steps through `lean_decode` (set by each `generate`)
        self.prefixes: PrefixCache | None = None  # the batches' shared prefixes, kept while the weights stay (`rl`)

    @property
    def call_end(self) -> CallEnd:
        """Who writes a call turn's <|im_end|> (chat.py): the encoder's, which encodes every turn."""
        return self.encoder.call_end

    @classmethod
    def from_config(cls, model: PreTrainedModel, tokenizer: Any, env: Environment, cfg: RolloutConfig) -> RolloutEngine:
        """The engine a run's `rollout` section asks for."""
        return cls(model, tokenizer, env, cfg.call_end)

    @torch.no_grad()
    def generate(self, tasks: Sequence[Task], params: SamplingParams, group_size: int = 1,
                 seed: int = 0, show_progress: bool = False) -> list[Episode]:
        """`group_size` episodes per task, in task order."""
        per_batch = max(1, params.batch_size // group_size)
        was_training = self.model.training
        self.model.eval()
        self.lean = self.lean_decoding and lean_decode_applies(self.model)
        bar = progress(len(tasks) * group_size, "rollout") if show_progress else None
        try:
            with cascade(self.model), precision(self.model):
                episodes: list[Episode] = []
                for i in range(0, len(tasks), per_batch):
                    batch = self._generate_batch(tasks[i:i + per_batch], params, group_size, seed, i * group_size)
                    episodes += batch
                    if bar is not None:
                        bar.update(len(batch))
                return episodes
        finally:
            self.model.train(was_training)
            if bar is not None:
                bar.close()

    def prompt_ids(self, task: Task) -> list[int]:
        """The ids an episode of `task` starts with: its prompt and the assistant's generation prompt."""
        return self.encoder.encode(conversation_pieces(task.prompt, add_generation_prompt=True))[0]

    def replay(self, tasks: Sequence[Task], params: SamplingParams) -> list[Episode]:
        """Each task's ground-truth trajectory as an episode, as if the policy had written it (OPS's
        expert rows): its assistant turns are fed one per turn, each encoded as the policy would sample
        it (stop token included; loss-masked like sampled tokens, log-prob 0.0 for the caller to fill),
        parsed and answered by the environment -- the observations come from really running the calls --
        under the same turn, token and length limits as `generate`."""
        episodes = []
        for task in tasks:
            prompt = self.prompt_ids(task)
            row = _Row(Episode(task.id, list(prompt), [0] * len(prompt), [0.0] * len(prompt), len(prompt)),
                       self.env.reset(task))
            ep = row.episode
            turns = [m for m in task.reference if m.role == "assistant"]
            for k, message in enumerate(turns[:params.max_turns]):
                ids = self.encoder.encode(assistant_body(message, self.call_end))[0][:params.max_new_tokens]
                ids = ids[:max(1, params.max_seq_len - len(ep.tokens))]
                ep.tokens += ids
                ep.loss_mask += [1] * len(ids)
                ep.logprobs += [0.0] * len(ids)
                row.turn_ids = ids
                if self._finish_turn([row], k == params.max_turns - 1, params.max_seq_len)[0] is None:
                    break
            else:  # the environment asked for more than the ground truth has
                ep.finish = "malformed"
            ep.success = self.env.success(row.state)
            episodes.append(ep)
        return episodes

    # ------------------------------------------------------------------ internals

    def _generate_batch(self, tasks: Sequence[Task], params: SamplingParams, group_size: int,
                        seed: int, first_row: int) -> list[Episode]:
        """The batch's rows are the call's rows first_row, first_row + 1, ...: their random streams."""
        prompts = [self.prompt_ids(t) for t in tasks]
        too_long = [t.id for t, p in zip(tasks, prompts) if len(p) >= params.max_seq_len]
        if too_long:
            raise ValueError(f"prompts of {too_long[:3]} exceed max_seq_len={params.max_seq_len}; raise it")
        cache, logits, attn, next_pos = self._prefill([p for p in prompts for _ in range(group_size)])
        rows = [_Row(Episode(t.id, list(p), [0] * len(p), [0.0] * len(p), len(p)), self.env.reset(t),
                     rng=row_stream(seed, first_row + k))
                for k, (t, p) in enumerate((t, p) for t, p in zip(tasks, prompts) for _ in range(group_size))]
        all_rows = list(rows)

        for turn in range(params.max_turns):
            rows, attn, next_pos = self._decode_turn(rows, cache, logits, attn, next_pos, params)
            chunks = self._finish_turn(rows, turn == params.max_turns - 1, params.max_seq_len)
            keep = [i for i, c in enumerate(chunks) if c is not None]
            if not keep:
                break
            if len(keep) < len(rows):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                drop_unread_groups(cache)  # (no row is parked between turns)
                attn, next_pos = attn[index], next_pos[index]
                rows = [rows[i] for i in keep]
                chunks = [chunks[i] for i in keep]
            logits, attn, next_pos = self._append(cache, chunks, attn, next_pos)
        for row in all_rows:
            row.episode.success = self.env.success(row.state)
        return [row.episode for row in all_rows]

    def _prefill(self, prompts: list[list[int]]):
        """Run the rows' prompts, each distinct prompt once (a task's G rollouts, HBG's hinted copies of a
        task): their shared prefix once into a CascadeLayer cache, then the distinct prompts' rests:
        long ones (>= `min_group_shared` tokens on average) each alone,
        causal, unpadded, kept once for the prompt's rows (`_prefill_groups`); else left-padded together,
        then copied to the rows. (cache, last logits [N, V], mask of the rows' own positions past the
        prefix [N, L], next positions [N]; N = len(prompts))."""
        first: dict[tuple[int, ...], int] = {}  # each distinct prompt's index among them, in order
        of = [first.setdefault(tuple(p), len(first)) for p in prompts]
        distinct = [list(p) for p in first]
        of = torch.tensor(of, device=self.device)  # [N] each row's prompt among the distinct ones
        shared = shared_prefix(distinct)
        if shared:
            prefix = (self.prefixes if self.prefixes is not None else PrefixCache(self.model))(distinct[0][:shared])
            cache = cascade_cache(self.model.config, prefix)
        else:
            cache = append_only_cache(self.model.config)
        rests = [p[shared:] for p in distinct]
        width = max(len(p) for p in rests)
        attn = torch.zeros((len(rests), width), dtype=torch.long)
        for i, p in enumerate(rests):  # left padding: every row's last position is real
            attn[i, width - len(p):] = 1
        attn = attn.to(self.device)
        next_pos = shared + attn.sum(dim=1)
        if (shared and len(distinct) < len(prompts)
                and sum(map(len, rests)) / len(rests) >= self.min_group_shared):
            logits = self._prefill_groups(cache, prefix, rests, attn, of)
            attn = attn[:, :0]  # the rows' own positions: none yet
        else:
            ids = torch.full((len(rests), width), self.pad_id, dtype=torch.long)
            for i, p in enumerate(rests):
                ids[i, width - len(p):] = torch.tensor(p)
            pos = shared + (attn.cumsum(dim=1) - 1).clamp(min=0)
            logits = self._forward(ids.to(self.device), attn, pos, cache)
            if len(distinct) < len(prompts):
                cache.batch_select_indices(of)
        return cache, logits[of], attn[of], next_pos[of]

    def _prefill_groups(self, cache, prefix: list[tuple[torch.Tensor, torch.Tensor]], rests: list[list[int]],
                        mask: torch.Tensor, of: torch.Tensor) -> torch.Tensor:
        """Each prompt's rest run alone against the prefix -- causal, so no padding and no mask to compute
        over (BFCL prompts on SmolLM2: the prefill 1.1-2.6x faster than left-padded together and repeated;
        docs/BENCHMARKS.md) -- and kept once, left-padded to `mask`'s width, as the group part that its rows
        (`of` [N]: each row's prompt) attend to (`CascadeLayer.set_groups`). Returns each prompt's last
        logits [n, V]."""
        shared, width = prefix[0][0].shape[-2], mask.shape[1]
        parts = None  # per layer: keys, values [n, Hkv, width, D]
        logits = []
        for i, rest in enumerate(rests):
            alone = cascade_cache(self.model.config, prefix, store=False)
            n = len(rest)
            out = forward(self.model, torch.tensor([rest], device=self.device), causal_mask(n, n, self.device),
                          torch.arange(shared, shared + n, device=self.device)[None], cache=alone, logits_to_keep=1)
            logits.append(out.logits[:, -1])
            if parts is None:
                _, heads, _, dim = alone.layers[0].keys.shape
                parts = [[x.new_zeros((len(rests), heads, width, dim)) for x in (layer.keys, layer.values)]
                         for layer in alone.layers]
            for (keys, values), layer in zip(parts, alone.layers):
                keys[i, :, width - n:], values[i, :, width - n:] = layer.keys[0], layer.values[0]
        for layer, (keys, values) in zip(cache.layers, parts):
            layer.set_groups(keys, values, mask, of)
        return torch.cat(logits)

    def _forward(self, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
        """Logits [N, V] at the last position of `ids` [N, T]; attn [N, L]: which cached positions (past
        the shared prefix) and new ones are real; the 4-D mask [N, 1, T, L] is built here: real positions,
        causal among the new ones."""
        mask = attn.bool()[:, None, None, :] & causal_mask(ids.shape[1], attn.shape[1], ids.device)
        if ids.shape[1] == 1 and self.lean:
            return lean_decode(self.model, ids, mask, pos, cache)
        return forward(self.model, ids, mask, pos, cache=cache, logits_to_keep=1).logits[:, -1]

    def _decode_turn(self, rows: list[_Row], cache, logits, attn, next_pos, params):
        """One assistant turn for every row, in lock-step. Once half the batch (and at
        least PARK_MIN rows) has ended its turn, those rows leave the batch -- their cache rows are set
        aside -- and come back, after the others, when the turn ends. Returns (rows in their new
        order, attn, next positions)."""
        for row in rows:
            row.turn_ids, row.generating = [], True
        parked = []  # (rows, their cache rows, attn, next positions) set aside this turn
        for _ in range(params.max_new_tokens):
            uniforms = None if params.greedy else torch.tensor(
                [row.rng.random() if row.generating else 0.0 for row in rows], dtype=torch.float64)
            tokens, logps = sample_next(logits.cpu(), params, uniforms)  # [N] each, on the CPU
            feed = torch.full((len(rows),), self.pad_id, dtype=torch.long)
            fed = torch.zeros(len(rows), dtype=torch.long)
            for i, row in enumerate(rows):
                if not row.generating:
                    continue
                tok = int(tokens[i])
                ep = row.episode
                ep.tokens.append(tok)
                ep.loss_mask.append(1)
                ep.logprobs.append(float(logps[i]))
                row.turn_ids.append(tok)
                feed[i], fed[i] = tok, 1
                if tok in self.stop_ids or len(ep.tokens) >= params.max_seq_len:
                    row.generating = False
            feed, fed = feed.to(self.device), fed.to(self.device)
            attn = torch.cat([attn, fed[:, None]], dim=1)
            logits = self._forward(feed[:, None], attn, next_pos[:, None], cache)
            next_pos = next_pos + fed
            live = [i for i, r in enumerate(rows) if r.generating]
            if not live:
                break
            if len(rows) - len(live) >= max(PARK_MIN, len(rows) // 2):
                done = torch.tensor([i for i, r in enumerate(rows) if not r.generating], device=self.device)
                parked.append(([rows[i] for i in done.tolist()], take_rows(cache, done), attn[done], next_pos[done]))
                index = torch.tensor(live, device=self.device)
                cache.batch_select_indices(index)
                rows, logits, attn, next_pos = [rows[i] for i in live], logits[index], attn[index], next_pos[index]
        for p_rows, p_cache, p_attn, p_pos in parked:
            add_rows(cache, p_cache)
            attn = torch.cat([attn, torch.nn.functional.pad(p_attn, (0, attn.shape[1] - p_attn.shape[1]))])
            rows, next_pos = rows + p_rows, torch.cat([next_pos, p_pos])
        return rows, attn, next_pos

    def _finish_turn(self, rows: list[_Row], last_turn: bool, max_seq_len: int) -> list[list[int] | None]:
        """Parse each row's turn, step the environment; the tokens to append, or None if the episode ended."""
        chunks: list[list[int] | None] = []
        for row in rows:
            ep = row.episode
            parsed = parse_turn_ids(row.turn_ids, self.id_to_tag, self.decode, row.state.tools, self.call_end)
            record = TurnRecord(start=len(ep.tokens) - len(row.turn_ids), end=len(ep.tokens), parsed=parsed)
            ep.turns.append(record)
            if parsed.end == "none":  # the environment still sees the turn (BFCL: a reply in this user turn)
                self.env.step(row.state, parsed)
                ep.finish = "context_limit" if len(ep.tokens) >= max_seq_len else "malformed"
                chunks.append(None)
                continue
            if last_turn and parsed.end == "call":
                ep.finish = "max_turns"
                chunks.append(None)
                continue
            observations = self.env.step(row.state, parsed)
            if not observations:
                ep.finish = "answered" if parsed.end == "answer" else "malformed"
                ep.final_text = row.state.final_text
                chunks.append(None)
                continue
            if last_turn:  # an answer the environment follows with another user turn, past the budget
                ep.finish = "max_turns"
                ep.final_text = row.state.final_text
                chunks.append(None)
                continue
            record.observation = "\n".join(m.content for m in observations)
            pieces = turn_suffix(parsed.end == "call", self.call_end) + [p for m in observations
                                                                          for p in message_pieces(m)]
            ids, _ = self.encoder.encode(pieces + generation_prompt())
            if len(ep.tokens) + len(ids) + 1 >= max_seq_len:
                ep.finish = "context_limit"
                chunks.append(None)
                continue
            ep.tokens += ids
            ep.loss_mask += [0] * len(ids)
            ep.logprobs += [0.0] * len(ids)
            chunks.append(ids)
        return chunks

    def _append(self, cache, chunks: list[list[int]], attn, next_pos):
        width = max(len(c) for c in chunks)
        ids = torch.full((len(chunks), width), self.pad_id, dtype=torch.long)
        new = torch.zeros((len(chunks), width), dtype=torch.long)
        for i, c in enumerate(chunks):
            ids[i, width - len(c):] = torch.tensor(c)
            new[i, width - len(c):] = 1
        ids, new = ids.to(self.device), new.to(self.device)
        pos = next_pos[:, None] + (new.cumsum(dim=1) - 1).clamp(min=0)
        attn = torch.cat([attn, new], dim=1)
        return self._forward(ids, attn, pos, cache), attn, next_pos + new.sum(dim=1)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


MIN_SHARED = 32  # a shorter common prefix is not worth a cache of its own
# Prompts' rests (past the batch's prefix) shorter than this on average stay a copy per row: reading a group's
# copy costs a dozen more small operators a layer, which a short rest does not repay (a decoding step's
# attention, 1 thread: 0.85x at the tiny tier's ~45-token questions, even at ~150-250 tokens, 1.5-2.1x at
# BFCL's ~2,900-token prompts on SmolLM2; `bench/group_share.py --attention`, docs/BENCHMARKS.md)
MIN_GROUP_SHARED = 256
PARK_MIN = 4  # rows that ended their turn leave the decoding batch only this many at a time, or more


def shared_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens every prompt starts with, leaving each at least one of its own (0 if under MIN_SHARED)."""
    first, limit = prompts[0], min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n if n >= MIN_SHARED else 0

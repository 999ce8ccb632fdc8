"""Supervision inside TRL's GRPOTrainer (integrations/trl/trainer.py, stats.py): the SFT term, unlikelihood's
rejected controls, OPS's and HBG's rows. Skipped where TRL is absent."""

from collections import Counter

import pytest
import torch

pytest.importorskip("trl", reason="the TRL integration needs TRL: pip install 'toolcollapse[trl]'")

from trl_helpers import _drive, _our_forward


def test_rejected_controls_marks_the_first_bad_control_token_of_each_sampled_turn(tokenizer):
    from toolcollapse.autopsy import control_tag_ids
    from toolcollapse.integrations.trl import rejected_controls

    id_to_tag = control_tag_ids(tokenizer)[0]
    tag = {t: i for i, t in id_to_tag.items()}
    word = tokenizer("hello", add_special_tokens=False)["input_ids"][0]
    # turn 1: a call closed by <|im_end|> inside it (full collapse); a tool response (mask 0); turn 2: a stray
    # </tool_call> and then <tool_response>: only the first is marked; then padding
    ids = [tag["<tool_call>"], word, tag["<|im_end|>"], word, word, tag["</tool_call>"], tag["<tool_response>"],
           tag["<|im_end|>"], 0]
    mask = [1, 1, 1, 0, 1, 1, 1, 1, 0]
    healthy = [word, word, tag["<|im_end|>"], 0, 0, 0, 0, 0, 0]
    out = rejected_controls(torch.tensor([ids, healthy]), torch.tensor([mask, [1, 1, 1, 0, 0, 0, 0, 0, 0]]), id_to_tag)
    assert out[0].nonzero().flatten().tolist() == [2, 5] and not out[1].any()


@pytest.mark.slow
def test_the_sft_term_trains_each_prompt_s_reference_once_and_equals_our_nll(tmp_path, answering_checkpoint):
    from transformers import AutoTokenizer

    from toolcollapse.model import load_model, logits_at

    (end,) = _drive(answering_checkpoint, tmp_path, "--steps", "2", "--sft-coef", "0.5", "--unlikelihood-coef", "0.5")
    first_log = end["log_history"][0]
    saved = torch.load(tmp_path / "rank0" / "first.pt")
    x = saved["inputs"]
    tokenizer = AutoTokenizer.from_pretrained(answering_checkpoint)
    kind, ids = x["sft_mask"], x["sft_ids"]
    carrying = (kind == 2).any(dim=1)
    prompts = [tokenizer.decode(p[m.bool()]) for p, m in zip(x["prompt_ids"], x["prompt_mask"])]
    assert int(carrying.sum()) == len(set(prompts)) == 2  # 8 rows, 2 prompts x 4: each reference once
    for i in carrying.nonzero().flatten().tolist():
        text = tokenizer.decode(ids[i][kind[i] == 2], skip_special_tokens=False)
        assert text.startswith("<tool_call>") and text.endswith("</tool_call><|im_end|>")
        assert tokenizer.decode(ids[i][kind[i] == 1]) == prompts[i]

    # its NLL, by our forward with the weights that step trained from
    model = load_model(answering_checkpoint)
    model.load_state_dict(saved["weights"])
    rows, k = ids[carrying], kind[carrying]
    width = int((k > 0).sum(dim=1).max())
    rows, k = rows[:, :width], k[:, :width]
    select = torch.zeros_like(k, dtype=torch.bool)
    select[:, :-1] = k[:, 1:] == 2
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(logits_at(model.eval(), rows, select), rows[k == 2])
    assert first_log["sup/sft_tokens"] == int((k == 2).sum()) and first_log["sup/sft_tokens_total"] == first_log[
        "sup/sft_tokens"]
    assert first_log["sup/sft_nll"] == pytest.approx(nll.item(), abs=1e-5)
    second = end["log_history"][1]
    assert second["sup/sft_tokens_total"] == first_log["sup/sft_tokens"] + second["sup/sft_tokens"]
    # unlikelihood: as many terms as rejected control tokens the parser found in the step's completions
    assert first_log.get("sup/unlikely_tokens", 0) == int(x["unlikely"].sum())


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_with_constant_rewards_the_sft_term_moves_the_weights_as_our_sft_step_on_the_same_batch(
        tmp_path, answering_checkpoint, processes):
    """Every reward 1: GRPO's advantages are 0 and (beta 0) its loss moves nothing, so one SGD step of TRL
    with the SFT term is exactly our SFT step (`SFTTerm`, token-mean NLL) on the references of the whole
    batch -- with two ranks, both ranks' references together: the terms of the ranks, averaged by DDP, add
    up to one token mean."""
    from toolcollapse.model import load_model
    from toolcollapse.supervision import SFTTerm

    lr, coef = 0.05, 0.5
    ends = _drive(answering_checkpoint, tmp_path, "--steps", "1", "--constant-reward", "--sft-coef", str(coef),
                  "--optim", "sgd", "--lr", str(lr), "--max-grad-norm", "0", processes=processes)
    assert all(e["log_history"][0]["reward_std"] == 0 for e in ends)
    examples = []
    for r in range(processes):
        x = torch.load(tmp_path / f"rank{r}" / "first.pt")["inputs"]  # one micro-batch: the rank's whole batch
        for ids, kind in zip(x["sft_ids"], x["sft_mask"]):
            if (kind == 2).any():
                examples.append((ids[kind > 0].tolist(), (kind[kind > 0] == 2).long().tolist()))
    assert len(examples) == 2 * processes  # each rank: 8 rows, 2 prompts, each reference once
    model = load_model(answering_checkpoint)
    model.load_state_dict(torch.load(tmp_path / "rank0" / "first.pt")["weights"])
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    SFTTerm(coef, 64, model.config.pad_token_id).backward(model.train(), examples)
    finals = [torch.load(tmp_path / f"rank{r}" / "final.pt") for r in range(processes)]
    moved = 0
    for name, p in model.named_parameters():
        ours = before[name] - lr * p.grad
        for final in finals:  # every rank ends with the same weights
            torch.testing.assert_close(final[name], ours, atol=1e-6, rtol=1e-5)
        moved += int((finals[0][name] != before[name]).sum())
    assert moved > 1000  # the step did move the weights


@pytest.mark.slow
@pytest.mark.parametrize("shaping", ["luffy", "none"])
def test_ops_puts_the_reference_in_one_row_of_each_group_and_shapes_its_loss(tmp_path, answering_checkpoint, shaping):
    from transformers import AutoTokenizer

    from toolcollapse.losses import luffy_loss

    (end,) = _drive(answering_checkpoint, tmp_path, "--steps", "2", "--ops", "1", "--ops-shaping", shaping)
    first_log = end["log_history"][0]
    saved = torch.load(tmp_path / "rank0" / "first.pt")
    x = saved["inputs"]
    tokenizer = AutoTokenizer.from_pretrained(answering_checkpoint)
    expert = x["expert"]
    assert int(expert.sum()) == 2 == first_log["sup/expert_rows"]  # 8 rows = 2 groups of 4: one expert row each
    texts = [tokenizer.decode(c[m.bool()], skip_special_tokens=False)
             for c, m in zip(x["completion_ids"], x["completion_mask"])]
    for text in (t for t, e in zip(texts, expert.tolist()) if e):  # the ground truth's first turn
        assert text.startswith("<tool_call>") and text.endswith("</tool_call><|im_end|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    own = x["completion_ids"][~expert][x["completion_mask"][~expert].bool()]
    assert first_log["ctrl/im_end/n_sampled"] == int((own == im_end).sum())  # the monitor leaves expert rows out
    if shaping == "none":
        assert "sup/expert_luffy_loss" not in first_log
        return
    # LUFFY's shaped loss of the expert tokens, from our forward with the same weights and TRL's advantages
    _, sampled, logp, _ = _our_forward(answering_checkpoint, saved, keep=expert)
    advantages = torch.cat([x["advantages"][expert][i].expand(int(sampled[i].sum())) for i in range(len(sampled))])
    assert first_log["sup/expert_luffy_loss"] == pytest.approx(luffy_loss(logp, advantages, 0.1).mean().item(), abs=1e-5)


@pytest.mark.slow
def test_hbg_samples_hinted_rows_with_the_hint_and_trains_them_on_the_plain_prompt(tmp_path, answering_checkpoint):
    from transformers import AutoTokenizer

    (end,) = _drive(answering_checkpoint, tmp_path, "--steps", "1", "--hbg", "1")
    tokenizer = AutoTokenizer.from_pretrained(answering_checkpoint)
    sampled_from = [tokenizer.decode(ids) for ids in torch.load(tmp_path / "rank0" / "sampled_from_0.pt")]
    hinted = ["Hint:" in text for text in sampled_from]
    assert hinted == [False, False, False, True] * 2  # rows 4k + 3: one of each group of 4
    x = torch.load(tmp_path / "rank0" / "first.pt")["inputs"]
    trained_on = [tokenizer.decode(p[m.bool()]) for p, m in zip(x["prompt_ids"], x["prompt_mask"])]
    assert not any("Hint:" in text for text in trained_on)  # every row trains on the plain prompt
    plain = {t for t, h in zip(sampled_from, hinted) if not h}
    assert Counter(trained_on) == {t: 4 for t in plain} and len(plain) == 2  # each group's 4 rows: its plain prompt
    assert end["log_history"][0]["sup/hinted_rows"] == 2

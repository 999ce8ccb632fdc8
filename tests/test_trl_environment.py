"""The tool world as a TRL environment and TRL's own tool loop in our chat format
(integrations/trl/environment.py). Skipped where TRL is absent."""


import pytest

pytest.importorskip("trl", reason="the TRL integration needs TRL: pip install 'toolcollapse[trl]'")

from trl_helpers import _scripted_trainer, _tool_world_args, _keeping


def test_the_tool_world_as_a_trl_environment_runs_the_real_tools_with_the_schemas_we_document():
    from transformers.utils import get_json_schema

    from toolcollapse.config import load_config
    from toolcollapse.integrations.trl import tool_world_dataset, tool_world_environment, tool_world_reward

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=50", "world.n_test=10", "world.n_ood=10"])
    env = tool_world_environment(cfg)()
    world = env.world
    assert len(world.tool_table) == 9
    for spec in world.tool_table.values():  # what TRL's chat template renders, from the method alone
        schema = get_json_schema(getattr(env, spec.name))["function"]
        assert schema["name"] == spec.name and schema["description"] == spec.description
        assert set(schema["parameters"]["properties"]) == set(spec.parameters["properties"])
        assert schema["parameters"].get("required", []) == spec.parameters.get("required", [])
        for name, prop in spec.parameters["properties"].items():
            assert schema["parameters"]["properties"][name]["type"] == prop["type"]
            assert schema["parameters"]["properties"][name].get("enum") == prop.get("enum")
    for split in ("train", "ood_facts"):  # a counterfactual task's tools answer from its own facts
        row = tool_world_dataset(cfg, split, 1)[0]
        task = world.tasks(split)[0]
        assert env.reset(**row) is None and env.task is task
        call = next(m.tool_call for m in task.reference if m.tool_call is not None)
        assert getattr(env, call.name)(**call.arguments) == world.run_call(call, task.meta.get("facts", "real"))
        assert env.calls == [(call.name, call.arguments)]
        right = [{"role": "assistant", "content": f"The answer is {task.answer}."}]
        assert tool_world_reward([right, [{"role": "assistant", "content": "The answer is 0."}]], [env, env]) == [1, 0]
    assert getattr(env, "kb_lookup")(entity="Nowhere", attribute="area_km2").startswith('{"error"')
    with pytest.raises(KeyError, match="not a task of this toolworld environment"):
        env.reset(task_id="train-99999")


@pytest.mark.slow
def test_trl_s_own_tool_loop_trains_on_the_tool_world_environment(tmp_path, answering_checkpoint):
    from transformers import AutoTokenizer
    from trl import GRPOConfig
    from trl.chat_template_utils import qwen2_5_chat_template

    from toolcollapse.config import load_config
    from toolcollapse.integrations.trl import (MonitoredGRPOTrainer, tool_world_dataset, tool_world_environment,
                                               tool_world_reward)
    from toolcollapse.model import load_model

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150"])
    tokenizer = AutoTokenizer.from_pretrained(answering_checkpoint)
    tokenizer.chat_template = qwen2_5_chat_template  # one TRL's tool loop knows; the same ChatML tags as ours
    data = tool_world_dataset(cfg, "train", 8)
    factory = tool_world_environment(cfg)
    env = factory()
    rendered = tokenizer.apply_chat_template(data[0]["prompt"], tools=[getattr(env, n) for n in env.world.tool_table],
                                             tokenize=False, add_generation_prompt=True)
    assert all(f'"name": "{n}"' in rendered for n in env.world.tool_table)
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=False,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=16, max_steps=1,
                      logging_steps=1, report_to="none", save_strategy="no", seed=0, beta=0.0)
    trainer = MonitoredGRPOTrainer(model=load_model(answering_checkpoint), reward_funcs=tool_world_reward, args=args,
                                   train_dataset=data, processing_class=tokenizer, environment_factory=factory)
    trainer.train()
    log = trainer.state.log_history[0]
    assert "tools/call_frequency" in log and "rewards/tool_world_reward/mean" in log
    assert sum(log[f"state/{s}"] for s in ("healthy_call", "healthy_response", "text_pollution",
                                            "full_collapse")) == pytest.approx(1.0)


@pytest.mark.slow
def test_trl_s_tool_loop_in_our_chat_format_builds_token_for_token_the_episodes_our_engine_builds(
        tmp_path, tiny_checkpoint):
    """TRL's own tool loop (parse, run the environment's tool, append the reply) on a toolcollapse model in
    its own chat format, its generations scripted to the ground truth's turns: the completions, their loss
    masks, the rewards and the four states equal our engine's replay of the same tasks, and so does the
    rollout rebuilt as our Episode (what PRS's judge reads). (With the real tiny SFT checkpoint, greedy, TRL
    and our engine sample the same episodes: bench/grpo_multiturn_vs_trl.py.)"""
    from toolcollapse.config import load_config
    from toolcollapse.envs import make_env
    from toolcollapse.evaluate import sampling_params
    from toolcollapse.integrations.trl import (rollout_episode, tool_world_dataset, tool_world_environment,
                                               tool_world_reward)
    from toolcollapse.model import load_model
    from toolcollapse.rollout import RolloutEngine

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150"])
    world = make_env(cfg)
    tasks = world.tasks("train")[:4]
    Scripted, tokenizer = _scripted_trainer(tiny_checkpoint, cfg, tasks,
                                            [[m for m in t.reference if m.role == "assistant"] for t in tasks])
    engine = RolloutEngine(load_model(tiny_checkpoint), tokenizer, world)
    replayed = {e.task_id: e for e in engine.replay(tasks, sampling_params(cfg, greedy=True))}
    trainer = Scripted(model=load_model(tiny_checkpoint), reward_funcs=tool_world_reward, args=_tool_world_args(tmp_path),
                       train_dataset=tool_world_dataset(cfg, "train", 4, system_prompt=True), processing_class=tokenizer,
                       environment_factory=tool_world_environment(cfg), tool_specs=world.tool_table)
    trainer.train()
    inputs, out = trainer.saved
    for i, x in enumerate(inputs):
        ep = replayed[x["task_id"]]
        keep = out["completion_mask"][i].bool()
        prompt = out["prompt_ids"][i][out["prompt_mask"][i].bool()]
        assert prompt.tolist() == ep.tokens[:ep.prompt_len]
        assert out["completion_ids"][i][keep].tolist() == ep.tokens[ep.prompt_len:]  # tool replies from our tools
        assert out["tool_mask"][i][keep].tolist() == ep.loss_mask[ep.prompt_len:]  # <|im_end|> after a call: 0
        rebuilt = rollout_episode(tasks[i // 2], prompt, out["completion_ids"][i][keep], out["tool_mask"][i][keep],
                                  tokenizer, world)
        assert (rebuilt.tokens, rebuilt.loss_mask, rebuilt.finish, rebuilt.final_text) == (
            ep.tokens, ep.loss_mask, ep.finish, ep.final_text)
        assert [(t.start, t.end, t.parsed, t.observation) for t in rebuilt.turns] == [
            (t.start, t.end, t.parsed, t.observation) for t in ep.turns]
    log = trainer.state.log_history[0]
    assert all(e.success for e in replayed.values()) and log["reward"] == 1.0
    turns = sum(len(e.turns) for e in replayed.values())
    calls = sum(t.parsed.end == "call" for e in replayed.values() for t in e.turns)
    assert calls > 0 and log["turns_per_episode"] == pytest.approx(turns / 4)
    assert log["state/healthy_call"] == pytest.approx(calls / turns) and log["healthy_rate"] == 1.0
    assert log["tools/call_frequency"] == pytest.approx(calls / 4)


def test_speak_toolcollapse_chat_makes_trl_stop_where_our_rollouts_stop_and_refuses_what_it_cannot_do(
        tmp_path, tiny_checkpoint):
    """Our chat format in TRL's tool loop: `</tool_call>` ends a generation (TRL cuts completions at the
    model's end tokens, not only where `generate` stopped), Qwen's call parser is set, vLLM and a model path
    are refused, and any other chat template is left alone."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    from toolcollapse.config import load_config
    from toolcollapse.integrations.trl import (MonitoredGRPOTrainer, speak_toolcollapse_chat, tool_world_dataset,
                                               tool_world_environment, tool_world_reward)
    from toolcollapse.model import load_model

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("</tool_call>", "<|im_end|>", "<|endoftext|>")}
    model = load_model(tiny_checkpoint)
    with pytest.raises(ValueError, match="vLLM"):
        speak_toolcollapse_chat(tokenizer, model, use_vllm=True)
    with pytest.raises(ValueError, match="model object"):
        speak_toolcollapse_chat(tokenizer, str(tiny_checkpoint))
    other = AutoTokenizer.from_pretrained(tiny_checkpoint)
    other.chat_template = qwen2_5_chat_template
    assert speak_toolcollapse_chat(other, model) is None and getattr(other, "response_template", None) is None
    assert speak_toolcollapse_chat(tokenizer, model, "sampled") is None  # the model writes its own <|im_end|>
    assert ids["</tool_call>"] not in model.generation_config.eos_token_id

    cfg = load_config("configs/tiny_rl.yaml", ["world.n_train=2000", "world.n_test=200", "world.n_ood=150"])
    model = load_model(tiny_checkpoint)
    end = ids["</tool_call>"]

    def close_at_once(module, inputs, output):  # the random model writes </tool_call> first, every turn
        output[..., end] += 30.0
        return output

    model.get_output_embeddings().register_forward_hook(close_at_once)
    trainer = _keeping(MonitoredGRPOTrainer)(
        model=model, reward_funcs=tool_world_reward, args=_tool_world_args(tmp_path, max_completion_length=32),
        train_dataset=tool_world_dataset(cfg, "train", 4, system_prompt=True), processing_class=tokenizer,
        environment_factory=tool_world_environment(cfg))
    assert set(ids.values()) <= set(model.generation_config.eos_token_id)
    assert tokenizer.response_template is not None
    trainer.train()
    _, out = trainer.saved
    completions = [c[m.bool()].tolist() for c, m in zip(out["completion_ids"], out["completion_mask"])]
    assert completions == [[end]] * 8  # cut there: no padding, no second generation (no call was opened)

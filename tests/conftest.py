import pytest
import torch

from toolcollapse.config import WorldConfig
from toolcollapse.envs.toolworld import ToolWorld
from toolcollapse.model import build_model
from toolcollapse.tokenizer import train_tokenizer

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def world() -> ToolWorld:
    return ToolWorld(WorldConfig(seed=0, n_train=2000, n_test=200, n_ood=150, sft_pool=1000, n_val=100))


@pytest.fixture(scope="session")
def tokenizer(world):
    return train_tokenizer(world.tokenizer_corpus(500), vocab_size=512)


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    model = build_model("tiny", len(tokenizer), 2048, tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_model, tokenizer):
    """The random tiny model saved as a checkpoint directory (what `toolcollapse sft` writes)."""
    path = tmp_path_factory.mktemp("tiny_checkpoint")
    tiny_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def answering_checkpoint(tmp_path_factory, tiny_model, tokenizer, world):
    """The tiny model after 12 SFT steps on `question -> "The answer is 7."`: most of its turns are
    healthy answers, some are not (~2 % at temperature 1, ~20 % at 2), so `grpo.format_reward` makes
    groups informative (at temperature 2 in most steps)."""
    import copy
    import random

    from toolcollapse.chat import PieceEncoder
    from toolcollapse.config import SFTConfig
    from toolcollapse.records import Message
    from toolcollapse.sft import Phase, train_phase

    model = copy.deepcopy(tiny_model).train()
    encoder = PieceEncoder(tokenizer)
    examples = [encoder.encode_conversation([t.prompt[-1], Message("assistant", "The answer is 7.")])
                for t in world.tasks("train")[:200]]
    torch.manual_seed(0)
    train_phase(model, Phase("answer", examples, 12, 16, 1), SFTConfig(lr=1e-2, warmup_steps=3, schedule="constant"),
                random.Random(0), tokenizer.pad_token_id, 0, dict, lambda record: None)
    path = tmp_path_factory.mktemp("answering")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

import pytest
import torch

from toolcollapse.config import WorldConfig
from toolcollapse.envs.toolworld import ToolWorld
from toolcollapse.model import build_model
from toolcollapse.tokenizer import train_tokenizer

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def world() -> ToolWorld:
    return ToolWorld(WorldConfig(seed=0, n_train=2000, n_test=200, n_ood=150))


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

"""tools/evaluate.py: perplexity on a .bin/.idx set equals exp(validation loss) of the training
loop on the same samples; LAMBADA-style last-word accuracy on a tiny JSON-lines file."""

import json
import math

import pytest
import torch

import pretrain_gpt
from data_helpers import gpt2_corpus
from megatron.core.parallel_state import ParallelState
from megatron.inference.evaluation import last_word_accuracy, read_last_word_examples
from megatron.inference.loading import load_model, model_from_full_state
from megatron.training.arguments import parse_args
from megatron.training.checkpointing import Checkpointer
from megatron.training.tokenizer import build_tokenizer
from megatron.training.training import pretrain
from inference_helpers import random_full_weights, write_checkpoint

torch.set_num_threads(1)
MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--max-position-embeddings 16 --make-vocab-size-divisible-by 32 --seed 1234").split()


def _corpus(tmp_path):
    return gpt2_corpus(tmp_path)


def test_perplexity_equals_exp_of_the_training_validation_loss(tmp_path, capsys):
    data = _corpus(tmp_path)
    config = parse_args(MODEL + data + (
        f"--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --train-iters 2 "
        f"--eval-interval 2 --eval-iters 2 --split 80,20,0 --log-interval 1 "
        f"--save {tmp_path / 'ckpt'}").split())
    pretrain_gpt.build_run_tokenizer(config)
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step, parallel_state=ParallelState.single_process(),
                      checkpointing=Checkpointer(config, log=lambda _: None), log=lambda _: None)
    # the in-loop evaluation at iteration 2 (samples 0..7) and the final one (samples 8..15)
    (_, in_loop), (_, final) = result.validation
    from tools.evaluate import main
    for first, losses in ((0, in_loop), (8, final)):
        assert main(["--load", str(tmp_path / "ckpt"), "--task", "perplexity", "--device", "cpu",
                     "--first-sample", str(first)]) == 0
        fields = capsys.readouterr().out.split("|")
        printed = {item.split()[0]: float(item.split()[1]) for item in fields}
        assert printed["samples"] == 8
        assert printed["loss"] == pytest.approx(losses["lm loss"], rel=1e-7)
        assert printed["perplexity"] == pytest.approx(math.exp(losses["lm loss"]), rel=1e-7)
    assert in_loop["lm loss"] != final["lm loss"]  # different samples: the offset matters


def _always_says_the(config, tokenizer):
    """Weights whose logits at every position favour the token " the" (final LayerNorm weight 0,
    its bias a direction that only that token's embedding row points along)."""
    full = random_full_weights(config, scale=0.05)
    target = tokenizer.tokenize(" the")
    assert len(target) == 1
    direction = torch.randn(32, generator=torch.Generator().manual_seed(1))
    full["decoder.final_layernorm.weight"] = torch.zeros(32)
    full["decoder.final_layernorm.bias"] = direction
    full["embedding.word_embeddings.weight"][target[0]] = 5 * direction
    return full


def test_last_word_accuracy_on_a_tiny_jsonl(tmp_path, capsys):
    data = _corpus(tmp_path)
    config = parse_args(MODEL + data + "--micro-batch-size 1 --global-batch-size 1 --lr 1e-3 "
                                       "--train-iters 1".split())
    tokenizer = build_tokenizer(config.data, config.model)
    pretrain_gpt.build_run_tokenizer(config)
    full = _always_says_the(config, tokenizer)
    examples = tmp_path / "lambada.jsonl"
    texts = ["she sat on the", "a cat ran to the", "he saw the cat", "the mat was on the"]
    examples.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    model = model_from_full_state(full, config)
    assert read_last_word_examples(str(examples)) == texts
    assert last_word_accuracy(model, tokenizer, texts) == 0.75  # " the" right 3 times, " cat" not

    write_checkpoint(tmp_path / "ckpt", config, full)
    from tools.evaluate import main
    assert main(["--load", str(tmp_path / "ckpt"), "--task", "lambada", "--input",
                 str(examples), "--device", "cpu"]) == 0
    assert "accuracy 0.75" in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    assert main(["--load", str(tmp_path / "ckpt"), "--task", "lambada", "--input",
                 str(tmp_path / "bad.jsonl"), "--device", "cpu"]) == 1
    assert load_model(str(tmp_path / "ckpt"))[1].data.tokenizer_type == "GPT2BPETokenizer"

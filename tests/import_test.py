"""scripts/import_hf.py: a MarianMTModel directory as OPUS-MT ships it (two sentencepiece models, one vocab.json,
pad the last id, swish or relu, trained attention biases and final_logits_bias) read into a workdir that
computes its function; fine-tuned from; exported back to Hugging Face and to CTranslate2. No network: the Marian
model is randomly initialised, its tokenizer built here. The refusals need no torch; the rest needs the export
extra, and is slow."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece as spm
from flax import nnx
from tiny import load_script, make_tiny_config, tree_digest
from transformer import batching, config_files, data, decode, trainer
from transformer.restore import restore
from transformer.tokenizer import EOS_ID, PAD_ID, UNK_ID

import_hf = load_script("import_hf")
export = load_script("export")

LAYERS, WIDTH = 2, 32
MARIAN = {"model_type": "marian", "d_model": WIDTH, "encoder_layers": LAYERS, "decoder_layers": LAYERS,
          "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
          "activation_function": "swish", "scale_embedding": True, "vocab_size": 300, "pad_token_id": 299,
          "decoder_start_token_id": 299}


# ----------------------------------------------------------------------------------------------------
# Refusals: no torch needed


@pytest.mark.parametrize("change, named", [
    ({"scale_embedding": False}, "scale_embedding=false"),
    ({"decoder_attention_heads": 8}, "encoder_attention_heads=4 but decoder_attention_heads=8"),
    ({"activation_function": "tanh"}, "activation_function='tanh'"),
    ({"decoder_vocab_size": 200}, "decoder_vocab_size=200 differs"),
    ({"decoder_start_token_id": 0}, "decoder_start_token_id=0 is not pad_token_id=299"),
])
def test_a_marian_model_we_cannot_represent_is_refused_naming_the_setting_before_anything_is_written(tmp_path, change,
                                                                                                   named):
    model_dir = tmp_path / "marian"
    model_dir.mkdir()
    for name in ("source.spm", "target.spm", "vocab.json"):
        (model_dir / name).write_text("{}")
    (model_dir / "config.json").write_text(json.dumps({**MARIAN, **change}))
    with pytest.raises(import_hf.ImportRefused, match=f"cannot import {model_dir}: .*{named}"):
        import_hf.import_model(str(model_dir), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_directory_without_marians_files_or_a_non_empty_workdir_is_refused(tmp_path):
    (tmp_path / "marian").mkdir()
    with pytest.raises(import_hf.ImportRefused, match="holds no config.json"):
        import_hf.import_model(str(tmp_path / "marian"), str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "mine.txt").write_text("keep me")
    with pytest.raises(import_hf.ImportRefused, match="exists and is not empty"):
        import_hf.import_model(str(tmp_path / "marian"), str(tmp_path / "run"))
    assert os.listdir(tmp_path / "run") == ["mine.txt"]


# ----------------------------------------------------------------------------------------------------
# A random OPUS-MT-shaped model, imported


def hf_modules():
    return pytest.importorskip("torch"), pytest.importorskip("transformers")


def train_sentencepiece(sentences, path, size):
    """As OPUS-MT's: unk 0, <s> 1, </s> 2, no pad (Marian's vocab.json adds it last)."""
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_prefix=str(path)[:-len(".model")],
                                   vocab_size=size, model_type="unigram", character_coverage=1.0, minloglevel=2)


def make_marian(directory, activation, seed):
    """A MarianMTModel directory: sentencepiece models trained on the built-in corpus's two sides, vocab.json
    ordered as OPUS-MT's (</s> 0, <unk> 1, the pieces, <pad> last), random weights with nonzero biases."""
    torch, transformers = hf_modules()
    pairs = data.read_split(config_files_settings().data, "train")
    os.makedirs(directory, exist_ok=True)
    for side, texts in (("source", [s for s, _ in pairs]), ("target", [t for _, t in pairs])):
        train_sentencepiece(texts, os.path.join(directory, f"{side}.model"), 150)
        os.replace(os.path.join(directory, f"{side}.model"), os.path.join(directory, f"{side}.spm"))
        os.remove(os.path.join(directory, f"{side}.vocab"))
    pieces = []
    for side in ("source", "target"):
        processor = spm.SentencePieceProcessor(model_file=os.path.join(directory, f"{side}.spm"))
        pieces += [processor.id_to_piece(i) for i in range(3, processor.get_piece_size())]
    vocab = {piece: i for i, piece in enumerate(dict.fromkeys(["</s>", "<unk>", *pieces, "<pad>"]))}
    with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as handle:
        json.dump(vocab, handle, ensure_ascii=False)
    tokenizer = transformers.MarianTokenizer(
        source_spm=os.path.join(directory, "source.spm"), target_spm=os.path.join(directory, "target.spm"),
        vocab=os.path.join(directory, "vocab.json"), source_lang="en", target_lang="es")
    tokenizer.save_pretrained(directory)
    pad = vocab["<pad>"]
    config = transformers.MarianConfig(**{**MARIAN, "vocab_size": len(vocab), "pad_token_id": pad,
                                          "decoder_start_token_id": pad, "activation_function": activation},
                                       eos_token_id=0, forced_eos_token_id=0, max_position_embeddings=256)
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config)
    with torch.no_grad():  # trained models have biases and LayerNorms away from their initial zeros and ones
        for name, value in model.named_parameters():
            if "layer_norm" in name or name.endswith("bias"):
                value.add_(0.1 * torch.randn_like(value))
        model.final_logits_bias.normal_(0, 0.5)
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=pad, pad_token_id=pad, eos_token_id=0, forced_eos_token_id=0, bad_words_ids=[[pad]],
        num_beams=1, do_sample=False, max_length=64)
    model.save_pretrained(directory)
    return model.eval(), tokenizer, vocab


def config_files_settings():
    from transformer.settings import Settings
    return Settings.from_config(config_files.plain(make_tiny_config()))


@pytest.fixture(scope="module", params=["swish", "relu"])
def imported(request, tmp_path_factory):
    """(the HF model, its tokenizer, its vocab.json, the imported workdir, what restore reads of it)."""
    root = tmp_path_factory.mktemp(f"marian-{request.param}")
    model, tokenizer, vocab = make_marian(str(root / "marian"), request.param, seed=len(request.param))
    workdir = str(root / "run")
    import_hf.import_model(str(root / "marian"), workdir, text_dir=None)
    return model, tokenizer, vocab, workdir, restore(workdir)


def to_ours(vocab):
    """Marian id -> our id (pad, eos, unk first, the rest in Marian's order)."""
    first = [vocab["<pad>"], vocab["</s>"], vocab["<unk>"]]
    order = first + [i for i in range(len(vocab)) if i not in first]
    table = np.zeros(len(vocab), np.int64)
    table[order] = np.arange(len(vocab))
    return table


SENTENCES = ["the cat sees a small house .", "a dog runs .", "we want three red apples and a book .",
             "hello", "the weather is nice today and the children play in the garden"]


@pytest.mark.slow
def test_the_pair_tokenizer_gives_marians_ids_renumbered_and_its_text(imported):
    _, tokenizer, vocab, workdir, restored = imported
    ours, table = restored.tokenizer, to_ours(vocab)
    assert ours.is_pair and ours.vocab_size == len(vocab)
    assert [ours.id_to_piece(i) for i in (PAD_ID, EOS_ID, UNK_ID)] == ["<pad>", "</s>", "<unk>"]
    theirs = tokenizer(SENTENCES)["input_ids"]
    assert [list(x) for x in ours.encode(SENTENCES)] == [table[x].tolist() for x in theirs]
    with tokenizer.as_target_tokenizer() if hasattr(tokenizer, "as_target_tokenizer") else nullcontext():
        targets = tokenizer(text_target=SENTENCES)["input_ids"]
    assert [list(x) for x in ours.encode(SENTENCES, "target")] == [table[x].tolist() for x in targets]
    for ids in targets:
        assert ours.decode(table[ids]) == tokenizer.decode(ids, skip_special_tokens=True)
    record = json.loads(open(os.path.join(workdir, "run.json")).read())
    assert record["imported"]["format"] == "MarianMTModel" and record["vocabulary"]["pieces"] == len(vocab)


def nullcontext():
    import contextlib
    return contextlib.nullcontext()


@pytest.mark.slow
def test_our_logits_are_marians_and_greedy_search_its_generate_token_for_token(imported):
    torch, _ = hf_modules()
    model, tokenizer, vocab, _, restored = imported
    table = to_ours(vocab)
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    decoder_inputs = np.full((len(SENTENCES), 7), vocab["<pad>"])
    decoder_inputs[:, 1:] = np.random.default_rng(0).integers(2, len(vocab) - 1, (len(SENTENCES), 6))
    with torch.no_grad():
        theirs = model(**batch, decoder_input_ids=torch.tensor(decoder_inputs)).logits.numpy()
    ours_model = nnx.merge(restored.graphdef, restored.params)
    mine = np.asarray(ours_model(jnp.asarray(table[batch["input_ids"].numpy()]), jnp.asarray(table[decoder_inputs])))
    print(f"max |Marian - our| logit {np.abs(theirs[..., np.argsort(table)] - mine).max():.2e}")
    np.testing.assert_allclose(theirs, mine[..., table], atol=1e-4, rtol=0)

    extra = 8
    search = decode.make_search(restored.graphdef, max_extra_length=extra, beam_size=1)
    found = decode.search_sentences(search, restored.params, restored.tokenizer, SENTENCES, 8,
                                    restored.input_bound).best_ids()
    for sentence, ids in zip(SENTENCES, found):
        inputs = tokenizer([sentence], return_tensors="pt")
        with torch.no_grad():
            generated = model.generate(**inputs, max_new_tokens=len(inputs["input_ids"][0]) + extra)[0].numpy()
        assert generated[0] == vocab["<pad>"]
        assert table[generated[1:]].tolist() == ids.tolist(), sentence


@pytest.mark.slow
def test_the_imported_workdir_exports_back_to_marians_weights(imported, tmp_path):
    """Import then export: every weight Marian had, in our id order (pad first), biases included."""
    torch, transformers = hf_modules()
    model, _, vocab, workdir, _ = imported
    output, _ = export.export(workdir, str(tmp_path / "hf"))
    again = transformers.MarianMTModel.from_pretrained(output).state_dict()
    order = np.argsort(to_ours(vocab))  # our id -> Marian's
    for name, value in model.state_dict().items():
        if ".embed_positions." in name:
            continue
        value = value.numpy()
        if name.endswith("embed_tokens.weight") or name in ("model.shared.weight", "lm_head.weight"):
            value = value[order]
        elif name == "final_logits_bias":
            value = value[:, order]
        np.testing.assert_allclose(again[name].numpy(), value, atol=1e-6, rtol=0, err_msg=name)
    config = json.loads(open(os.path.join(output, "config.json")).read())
    assert config["activation_function"] == model.config.activation_function


@pytest.mark.slow
def test_a_fine_tune_from_the_imported_workdir_trains_from_its_parameters(imported, tmp_path):
    _, _, _, workdir, restored = imported
    config = config_files.plain(load_config("finetune", workdir))
    config["train"].update(num_train_steps=2, eval_every_steps=2, checkpoint_every_steps=2, log_every_steps=1)
    config["data"].update(builtin_train_size=400, builtin_valid_size=16, builtin_test_size=16, max_length=32,
                          tokens_per_batch=256)
    config["decode"].update(bleu_splits="")
    before = tree_digest(workdir)
    new = str(tmp_path / "ft")
    trainer.Run(config, new).train()
    record = json.loads(open(os.path.join(new, "run.json")).read())
    assert record["init_from"]["workdir"] == os.path.abspath(workdir) and record["init_from"]["step"] == 0
    tuned = restore(new)
    assert tuned.step == 2 and tuned.tokenizer.is_pair
    moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
             zip(jax.tree.leaves(tuned.params), jax.tree.leaves(restored.params))]
    assert 0 < max(moved) < 0.1  # two small steps away from the imported parameters, not a fresh init
    assert tree_digest(workdir) == before


def load_config(name, argument):
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(argument)


@pytest.mark.slow
def test_the_ctranslate2_export_of_the_imported_model_decodes_our_tokens(imported, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    _, _, _, workdir, restored = imported
    output, _ = export.export(workdir, str(tmp_path / "ct2"), output_format="ctranslate2")
    assert {"model.bin", "config.json", "shared_vocabulary.json", "source.spm", "target.spm"} <= set(
        os.listdir(output))
    assert_ctranslate2_gives_ours(ctranslate2.Translator(output, device="cpu"), restored, SENTENCES, beams=(1,))


def assert_ctranslate2_gives_ours(translator, restored, sentences, extra=8, beams=(1, 4)):
    """CTranslate2's greedy and beam-4 searches (no length penalty in either: CTranslate2's is another formula)
    give our tokens. A translation that ends before its limit must be ours exactly; one that reaches it (ours
    then allows only EOS, CTranslate2 stops) must agree up to it, in greedy search. -> how many ended, by beam."""
    tokenizer = restored.tokenizer
    encoded, _ = batching.cut_to_bound(tokenizer.encode(sentences), restored.input_bound)  # as ours are cut
    ended = {}
    for beam in beams:
        search = decode.make_search(restored.graphdef, max_extra_length=extra, beam_size=beam, alpha=0.0)
        ours = decode.search_sentences(search, restored.params, tokenizer, sentences, 8,
                                       restored.input_bound).best_ids()
        ended[beam] = 0
        for sentence, ids, mine in zip(sentences, encoded, ours):
            limit = len(ids) + extra
            [result] = translator.translate_batch([tokenizer.pieces(ids)], beam_size=beam,
                                                  length_penalty=0.0, max_decoding_length=limit,
                                                  suppress_sequences=[[tokenizer.id_to_piece(PAD_ID)]],
                                                  return_end_token=True)
            theirs = [tokenizer.piece_to_id(piece) for piece in result.hypotheses[0]]
            if len(mine) < limit:
                assert theirs == mine.tolist(), (beam, sentence)
                ended[beam] += 1
            elif beam == 1:
                assert theirs[:limit - 1] == mine.tolist()[:limit - 1], (beam, sentence)
    return ended

"""Every setting of the project, with its default and its meaning in a line: the one schema of defaults.

The typed sections of the package (data.DataConfig, model.ModelConfig, ...) take their field defaults from here
(config_files.section), configs/default.py (the zero-setup quick start) is these values as they are, and every other
config starts from it and overrides. This module imports nothing of the package: every layer may read it.
"""

import ml_collections


def data_defaults() -> ml_collections.ConfigDict:
    data = ml_collections.ConfigDict()
    data.source = "builtin"  # builtin (synthetic, no download) | text (local files) | tfds (TFDS dataset)
    data.source_lang = "en"  # translate from this language...
    data.target_lang = "es"  # ...into this one
    data.builtin_seed = 0  # seed of the built-in corpus generator
    data.builtin_train_size = 100_000  # sentence pairs in the built-in train split
    data.builtin_valid_size = 1_000  # ... valid split
    data.builtin_test_size = 1_000  # ... test split
    data.text_dir = ""  # source=text: folder with {split}.{lang} files (one sentence per line, .gz allowed)
    data.tfds_name = ""  # source=tfds: dataset/config, e.g. wmt14_translate/de-en
    data.tfds_data_dir = ""  # source=tfds: where the prepared dataset lives (TFDS's default when empty)
    data.train_split = "train"  # tfds split name, or text file prefix, of the training data
    data.valid_split = "valid"  # ... of the dev set (eval loss, BLEU, checkpoint choice)
    data.test_split = "test"  # ... of the test set (BLEU only; never used for selection)
    data.vocab_path = ""  # an existing sentencepiece model; empty: train one on the train split into the workdir
    data.vocab_size = 1000  # size of the joint source+target sentencepiece vocabulary
    data.vocab_model_type = "unigram"  # sentencepiece's unigram LM | bpe (byte-pair merges, the paper's kind)
    data.vocab_character_coverage = 1.0  # sentencepiece character_coverage
    data.vocab_max_sentences = 1_000_000  # sentences sampled (seeded) from the whole train split for the vocabulary
    data.vocab_max_characters = 0  # ... and at most this many characters of them (0: no limit)
    data.max_length = 64  # tokens per packed row; training pairs longer than this on either side are dropped
    data.tokens_per_batch = 2048  # token budget per step and side (all processes): rows = tokens_per_batch // max_length
    data.pack = True  # several pairs per row (segments never see each other); false: one pair per row
    data.num_workers = 0  # grain worker processes that tokenize the train split and pack batches (0: in-process)
    data.local_cache_dir = ""  # a gs:// workdir's local copies (token cache, vocabulary); empty: ~/.cache/transformer
    # Training from several corpora (transformer/mixture.py): comma-separated WEIGHT:KIND[:WHERE] entries, KIND one
    # of main (the source above, listed once), text:DIR, synthetic:DIR (a text folder of back-translations),
    # tfds:NAME or builtin:SEED (the built-in corpus with that seed), each read at its train_split, e.g. "1:main,0.5:synthetic:runs/bt". Weights are shares of the
    # training pairs. Empty: the source above alone. Valid and test always come from the source above.
    data.mixture = ""
    data.tag_synthetic = False  # put the control token <bt> before every source of a synthetic corpus (needs a
    # vocabulary trained with it: set from the run's first start)
    # Cleaning of the training sources (never valid or test), each dropped pair counted in the log:
    data.filter_max_ratio = 0.0  # drop pairs whose sides' token counts differ by more than this factor (0: off)
    data.filter_duplicates = False  # drop every repeat of an exact (source, target) pair but the first
    data.filter_copies = False  # drop pairs whose source equals its target (untranslated copies)
    data.filter_max_characters = 0  # drop pairs with a side over this many characters (0: off)
    data.filter_language = False  # drop pairs whose sides py3langid does not identify as source_lang, target_lang
    # (the langid extra: pip install -e ".[langid]"; its model ships in the wheel)
    return data


def model_defaults() -> ml_collections.ConfigDict:
    model = ml_collections.ConfigDict()
    # The family built from the paper's layers (docs/families.md): encoder_decoder (the paper's) | decoder_only (a
    # language model over `source <sep> target`, loss on the target: set num_encoder_layers=0) | encoder_only (a
    # masked language model, no BLEU: set num_decoder_layers=0)
    model.family = "encoder_decoder"
    model.prefix_lm = True  # decoder_only: the source prefix attends bidirectionally to itself (false: causal too)
    model.masked_side = "source"  # encoder_only reads and masks: source | target | both (the pair joined, as XLM's TLM)
    model.mask_rate = 0.15  # encoder_only: the share of tokens masked, of which 80% -> <mask>, 10% random, 10% kept
    model.emb_dim = 128  # d_model
    model.num_heads = 4  # h (must divide emb_dim)
    model.num_encoder_layers = 3  # N of the encoder
    model.num_decoder_layers = 3  # N of the decoder
    model.mlp_dim = 512  # d_ff of the position-wise feed-forward
    # P_drop on embeddings and sublayer outputs: the paper's 0.1 in base.py; 0 here, where each pair is seen ~once
    model.dropout_rate = 0.0
    model.attention_dropout_rate, model.relu_dropout_rate = 0.0, 0.0  # on attention weights, after the FFN activation
    model.activation = "relu"  # the feed-forward's: relu (paper) | swish (SiLU: most OPUS-MT models) | gelu (exact)
    model.projection_bias, model.output_bias = False, False  # biases on attention's projections, on the logits (Marian's)
    model.positional_encoding = "sinusoidal"  # sinusoidal (paper) | learned
    model.max_length = 256  # positions of the learned table (unused by sinusoids)
    model.decoder_positions = True  # False: no positions in the decoder's embeddings (NoPE; encoder_decoder only)
    model.layer_norm = "post"  # post (paper: LayerNorm(x + sublayer(x))) | pre (with a final norm per stack)
    model.layer_norm_epsilon = 1e-5  # LayerNorm epsilon (torch's, fairseq's and Marian's; exports token for token)
    model.share_embeddings = True  # one embedding for source and target (needs the joint vocabulary)
    model.tie_output_embedding = True  # pre-softmax projection = target embedding transposed
    model.dtype = "float32"  # compute dtype of the matmuls: float32 | bfloat16 (parameters stay float32)
    model.attention = "reference"  # reference (ours, any backend) | xla | cudnn (flash attention, GPU + bfloat16)
    # The attention of each kind of sublayer (docs/attention.md): dense (the paper's) | local (the keys within
    # model.local_window positions: the paper's restricted self-attention) | linformer (keys and values projected
    # along the length to model.linformer_length rows) | performer (softmax estimated by model.performer_features
    # positive random features: linear in the length) | any kind registered with transformer.model.register
    # (docs/design.md). linformer and performer take one sentence per row: data.pack=false. A comma-separated list
    # is a per-layer pattern, cycled over the stack's layers: "local,dense" alternates them
    model.encoder_attention = "dense"  # dense | local | linformer | performer, or a pattern of them
    model.decoder_attention = "dense"  # dense | local (itself and the window's r positions before it) | performer | ssm
    model.cross_attention = "dense"  # dense | performer
    model.local_window = 16  # r of local attention: keys at distance <= r (a decoding cache of r + 1 positions)
    model.linformer_length = 32  # k of linformer: the projected length (inputs up to model.max_length tokens)
    model.performer_features = 256  # m of performer: random features, drawn from config.seed (a state of m x d_k)
    # ssm (decoder only; docs/attention.md): Mamba-2's state-space mixer, a fixed-size state per layer in decoding
    model.ssm_state = 64  # N: the state per head is N x ssm_head_dim
    model.ssm_expand = 2  # the mixer's inner width: ssm_expand x emb_dim
    model.ssm_head_dim = 64  # P: heads = ssm_expand x emb_dim / P, each with its own decay
    model.ssm_conv = 4  # taps of the causal depthwise convolution before the recurrence
    model.ssm_chunk = 64  # tokens per chunk of the parallel (training) form: quadratic inside, scanned between
    # Mixture of experts (docs/moe.md): the feed-forward of every expert_every-th layer of each stack becomes
    # num_experts feed-forwards, each token routed to its experts_per_token best (top-k token choice) within the
    # capacity of each expert; the load-balancing and router z-losses join the training loss.
    model.num_experts = 0  # 0: the paper's one feed-forward in every layer
    model.expert_every = 2  # layers expert_every - 1, 2 expert_every - 1, ... of each stack (2: every other, GShard)
    model.experts_per_token = 2  # top-k routing: 1 (Switch) | 2 (GShard)
    model.capacity_factor = 1.25  # each expert takes capacity_factor x k x row tokens / num_experts per row
    model.eval_capacity_factor = 2.0  # the same in evaluation and decoding (0: no limit, no token dropped)
    model.router_balance_weight = 0.01  # weight of the load-balancing loss (1.0 when balanced; Switch's alpha)
    model.router_z_weight = 0.001  # weight of the router z-loss, mean squared logsumexp of the router (ST-MoE)
    model.remat = False  # recompute each layer in the backward pass: less activation memory, ~1/3 more compute
    model.scan_layers = False  # one lax.scan per stack, params [layers, ...]: compile time flat in depth (another layout)
    model.init_std = 0.0  # 0: lecun-normal kernels, N(0, d^-0.5) embeddings; > 0: all N(0, init_std) (Marian: 0.02)
    return model


def optimizer_defaults() -> ml_collections.ConfigDict:
    optimizer = ml_collections.ConfigDict()
    optimizer.learning_rate_scale = 0.5  # lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    optimizer.warmup_steps = 200  # warmup_steps of the schedule
    optimizer.decay = "rsqrt"  # after the warmup: rsqrt (the paper) | constant (a warmup-stable-decay with cooldown)
    optimizer.adam_b1 = 0.9  # Adam beta1
    optimizer.adam_b2 = 0.98  # Adam beta2
    optimizer.adam_eps = 1e-9  # Adam epsilon
    optimizer.grad_clip_norm = 0.0  # clip gradients to this global norm; 0 = no clipping (the paper's choice)
    optimizer.cooldown_fraction = 0.0  # decay the lr linearly toward 0 over this last fraction of the run (of
    # num_train_steps, or of train.max_train_minutes when that begins first); 0 = the paper's schedule to the end
    return optimizer


def train_defaults() -> ml_collections.ConfigDict:
    train = ml_collections.ConfigDict()
    train.num_train_steps = 750  # optimizer updates
    train.label_smoothing = 0.1  # epsilon_ls
    train.log_every_steps = 50  # fetch and log training metrics every N steps (the only host sync)
    train.eval_every_steps = 250  # eval loss / accuracy / perplexity on the valid split
    train.bleu_every_steps = 0  # decode and score BLEU during training every N steps (0: only at the end)
    train.checkpoint_every_steps = 250  # save a checkpoint every N steps (and always at the end)
    train.keep_checkpoints = 3  # keep the last K train states (decode.average_last keeps params snapshots of its own)
    train.checkpoint_every_minutes = 0.0  # also save at the first log step this many training minutes after a save
    train.async_checkpointing = True  # save in the background while training goes on
    train.keep_best_checkpoint = False  # also keep the best-dev-BLEU checkpoint in workdir/best_checkpoint (valid only)
    train.max_train_minutes = 0.0  # a CPU/GPU-time budget: stop after this many minutes of training (0: none)
    train.report_minutes = ""  # e.g. "20": at these training minutes also score the averaged last checkpoints
    train.num_microbatches = 1  # gradient accumulation: split each batch into N sequential slices, one update
    train.compilation_cache_dir = ""  # JAX's persistent compilation cache ("": workdir/compilation_cache; "none": off)
    train.dropout_rng = "counter_hash"  # counter_hash (cheapest) or threefry2x32: same masks on any mesh; rbg | unsafe_rbg
    # A step whose loss or gradient norm is not finite is caught at the next log or checkpoint step, before any save:
    # "stop" ends the run naming the step and the last good checkpoint; "skip" leaves such updates out and logs them.
    train.nonfinite = "stop"
    # Under "skip", more skipped updates than this in the whole run stop it as "stop" would: the shipped configs skip
    # none, isolated bad batches are a handful, and 50 stops a diverging run within a few log windows.
    train.max_skipped_updates = 50
    train.debug_nans = False  # jax_debug_nans: re-runs the step op by op at the first NaN to name its source (slow)
    train.wandb_project = ""  # also log to this Weights & Biases project (pip install -e ".[wandb]")
    train.profile_steps = ""  # "N-M": a profiler trace of steps N to M in workdir/profile (TensorBoard, Perfetto)
    # A warm start (fine-tuning): "WORKDIR", "WORKDIR:STEP", "WORKDIR:best" or "WORKDIR:avgK" (the mean of its last
    # K checkpoints): a new run's parameters and vocabulary come from that run's; optimizer, schedule and data
    # position start afresh. "": parameters drawn from config.seed
    train.init_from = ""
    # mle: token-level likelihood (the paper's) | risk: minimum risk training (Shen et al. 2016; Edunov et al. 2018)
    # mixed with it: (1 - risk_weight) x the token loss + risk_weight x each sentence's expected 1 - BLEU over
    # risk_candidates samples of the model, per reference token (docs/training.md). Takes data.pack=false
    train.objective = "mle"
    train.risk_weight = 0.7  # the share of the sequence risk in the objective (Edunov et al.'s best mix: 0.7)
    train.risk_candidates = 8  # k: samples per source sentence, drawn on the device each step (temperature 1)
    return train


def mesh_defaults() -> ml_collections.ConfigDict:
    # Devices: a mesh of (data, fsdp, expert, tensor); one size may be -1 (the remaining devices). Logical axis names
    # of the parameters map to mesh axes by `rules` (transformer/sharding.py): `name=axis[+axis], ...`.
    mesh = ml_collections.ConfigDict()
    mesh.data = -1  # data parallelism (parameters replicated)
    mesh.fsdp = 1  # fully sharded data parallelism (parameters and optimizer state split along `embed`)
    mesh.tensor = 1  # tensor parallelism (`mlp`, `heads`, `vocab` split)
    mesh.expert = 1  # expert parallelism: a mixture of experts' experts split, the batch too (model.num_experts)
    # logical axis -> mesh axes; `layers` (model.scan_layers' stacked axis) stays whole: a scan reads every layer
    mesh.rules = "batch=data+fsdp+expert, embed=fsdp, mlp=tensor, heads=tensor, vocab=tensor, expert=expert, layers=none"
    return mesh


def decode_defaults() -> ml_collections.ConfigDict:
    decode = ml_collections.ConfigDict()
    decode.batch_size = 256  # sentences per decoding batch
    decode.max_extra_length = 50  # output may be up to input length + this many tokens (the paper's +50)
    decode.bleu_splits = "valid,test"  # comma-separated splits decoded and scored at the end of training
    decode.beam_size = 1  # 1 = greedy search (fast; the quick start's choice); base/big use the paper's 4
    decode.alpha = 0.6  # length penalty exponent of beam search (the paper's 0.6 with gnmt's form)
    decode.length_penalty = "gnmt"  # beam scores log P / lp: gnmt ((5 + length) / 6)^alpha | fairseq length^alpha
    decode.early_stopping = True  # a sentence stops once no live beam can beat its finished ones
    decode.temperature = 0.0  # > 0: sample from softmax(logits / temperature) instead of searching (research use; beam_size 1)
    decode.top_k = 0  # with temperature > 0: sample among the k most likely tokens only (0 = all)
    decode.top_p = 0.0  # with temperature > 0: nucleus sampling, the fewest top tokens holding p (0 or 1 = all)
    decode.average_last = 0  # the run's end, eval.py, translate average the last N checkpoints (0 or 1: none)
    decode.cache_blocks = 0  # the self-attention cache in N blocks, a step reads only those written so far: faster
    # steps, longer compilation; outputs do not depend on it. 0: 4 for beam search, 1 for greedy (decode.py)
    decode.weights = "float32"  # bfloat16: searches run on bfloat16 weights and matmuls (float32 logits, softmax)
    decode.shrink = 0  # the batch halves up to N times as its sentences finish (same outputs; pays on CPU, docs/
    # benchmarks.md "Shrinking batches"; each halving is one more compiled loop)
    decode.max_input_length = 0  # longer sources are cut to it, EOS kept, still scored (0: data.max_length); never
    # past a learned position table
    decode.max_tokens_per_batch = 16384  # sentences x padded source length per decoding batch: long ones come fewer
    # to a batch, in whole rows per device (0: no budget, decode.batch_size sentences whatever their length)
    decode.epsilon = 0.0  # sampling: drop tokens of probability < epsilon, the most likely always kept (0 = off)
    # Minimum Bayes risk decoding (README "MBR decoding"): N candidates per sentence, the one that agrees most with
    # the others under a utility returned. batch_size and max_tokens_per_batch then count candidates.
    decode.search = "auto"  # auto: greedy / beam / sampling by beam_size and temperature | mbr
    decode.mbr_candidates = 16  # N: samples, or the n-best of a beam of N
    decode.mbr_from = "samples"  # samples (at temperature, 0 read as 1; epsilon, top_k, top_p) | beam (beam_size unused)
    decode.mbr_utility = "chrf"  # chrf | bleu (sacreBLEU's sentence-level scores, on the host)
    return decode


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0  # one seed for parameters, dropout (fold_in(seed, step)) and data order
    config.data = data_defaults()
    config.model = model_defaults()
    config.optimizer = optimizer_defaults()
    config.train = train_defaults()
    config.mesh = mesh_defaults()
    config.decode = decode_defaults()
    return config

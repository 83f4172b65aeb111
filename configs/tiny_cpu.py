"""Tiny MoE config for CPU: the default of `make train` and the one shape the tests share.

Run:  gagar-train --config configs/tiny_cpu.py --workdir runs/tiny_cpu
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.debug_checks = False          # chex conservation asserts inside the jitted step
    # "" | grpo | dapo | drgrpo | gspo | cispo: sets docs/loss.md's recipe keys (explicit
    # --config.KEY=VALUE overrides keep theirs)
    c.recipe = ""

    m = c.model = ml_collections.ConfigDict()
    m.vocab_size = 256
    m.hidden_size = 64              # D
    m.num_layers = 2
    m.num_heads = 4
    m.num_kv_heads = 2              # GQA
    m.head_dim = 16
    m.moe_intermediate_size = 32    # F, per expert
    m.intermediate_size = 128       # dense-layer MLP width
    m.num_dense_layers = 0          # first layers with a dense MLP instead of MoE
    m.num_experts = 8               # E
    m.top_k = 2                     # K
    m.norm_topk_prob = True         # renormalize the top-k gate weights
    m.router = "softmax"            # softmax | sigmoid_bias (aux-loss-free balancing)
    m.rope_theta = 10000.0
    m.rms_norm_eps = 1e-6
    m.tie_embeddings = False
    m.param_dtype = "float32"
    m.compute_dtype = "float32"
    m.remat = "none"                # none | full | save_matmuls
    m.attention = "blockwise"       # blockwise | plain
    m.attn_block = 64               # query/key block for the blockwise path
    m.expert_backend = "grouped"    # dense | ragged | grouped | ep | ep_a2a | megablox | auto
    m.ep_local_ffn = "auto"         # ep_a2a's per-chip FFN: grouped | megablox | auto
    m.ep_chunks = 0                 # ep_a2a's token chunks per exchange (0 = expert-axis size)
    m.ep_row_tile = 0               # ep_a2a's megablox row tile (0 = the kernel's 512)
    m.logprob_vocab_chunk = 128     # vocab chunk for log-probs/entropy
    m.logprob_keep_logits_mib = 0   # 0: the log-prob backward recomputes logits (memory flat in V)
    m.router_aux_loss_coef = 1e-3
    m.router_z_loss_coef = 1e-4
    m.router_bias_update_rate = 1e-3
    # MiMo-V2-Flash family features (docs/model.md); these defaults are the Qwen3-MoE layout.
    m.layer_types = ()              # per layer "full" | "sliding"; () = all full
    m.sliding_window = 0            # sliding layers: a query sees W keys counting itself
    # Hub sliding_window_size N = W (vllm) | W - 1 (transformers)
    m.sliding_window_convention = "vllm"
    m.sliding_num_kv_heads = 0      # KV heads of sliding layers (0 = num_kv_heads)
    m.attention_sinks = False       # per-head sink logit on sliding layers
    m.v_head_dim = 0                # value head width (0 = head_dim)
    m.attention_value_scale = 1.0   # values scaled before attention
    m.partial_rotary_factor = 1.0   # RoPE on the first int(head_dim * factor) q/k dims
    m.sliding_rope_theta = 0.0      # RoPE base of sliding layers (0 = rope_theta)
    m.qk_norm = True                # per-head RMSNorm of q and k
    m.n_group = 1                   # group-limited routing: expert groups ...
    m.topk_group = 1                # ... of which a token's top_k come from the best topk_group
    m.routed_scaling_factor = 1.0   # gate weights x this factor
    m.hf_family = "auto"            # export family: auto | qwen3_moe | mimo_v2_flash

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1                # -1 = all remaining devices
    c.mesh.fsdp = 1
    c.mesh.expert = 1
    c.mesh.context = 1              # sequence (context) parallelism: rows split along S
    c.mesh.tensor = 1
    # Several TPU slices or GPU hosts: how many of them each axis spans over the slow network
    # (DCN); the sizes above are totals. All 1 = automatic: the lightest axes (data, fsdp, ...)
    # take the slow network. Inside a slice the axes follow the torus (docs/scaling.md).
    c.mesh.dcn_data = 1
    c.mesh.dcn_fsdp = 1
    c.mesh.dcn_expert = 1
    c.mesh.dcn_context = 1
    c.mesh.dcn_tensor = 1

    t = c.train = ml_collections.ConfigDict()
    # train steps (one step = one feed batch); a finite feed may end sooner
    t.steps = 6
    t.checkpoint_every = 2          # orbax save interval, in steps
    t.keep_checkpoints = 3          # keep the last K checkpoints
    t.publish_every = 0             # publish HF-format weights every N steps (0 = never)
    # with publish_every > 0: publish the initial policy as version 0 before a fresh run's first
    # step, so rollout workers have weights to sample the first groups with (never on a resume)
    t.publish_initial = True
    t.keep_published = 2            # keep the last K published weight sets
    t.publish_dtype = "bfloat16"    # published weights' dtype (router + its bias stay fp32 in MiMo)
    # K: every K-th publish is full, the K - 1 between are deltas (only the elements that changed
    # in publish_dtype; engines apply them with gagar_jax.rollout.delta); 1 = every publish full
    t.publish_full_every = 1
    t.log_every = 1                 # metrics.jsonl / TensorBoard interval, in steps
    # HF Qwen3-MoE / MiMo-V2-Flash directory to start from ("" = random init)
    t.init_from = ""
    t.reference_from = ""           # KL reference policy directory ("" = the initial weights)

    # Steps inside one train step (gagar_jax/run/step.py): epochs x mini_batches optimizer
    # updates per feed batch, each accumulated over micro_batches; B must divide by
    # mini_batches * micro_batches (rows are split along B, see docs/loss.md).
    t.epochs = 1                    # passes over the feed batch
    t.mini_batches = 1              # optimizer updates per epoch
    t.micro_batches = 2             # gradient-accumulation chunks per mini-batch (lax.scan)

    lo = c.loss = ml_collections.ConfigDict()   # see docs/loss.md
    lo.clip_low = 0.2               # ratio >= 1 - clip_low for negative advantages
    lo.clip_high = 0.28             # clip-higher (DAPO): ratio <= 1 + clip_high for positive ones
    # None, or c > 1: caps a negative-advantage token's loss at c*|A|
    lo.dual_clip = None
    # truncated IS weight cap (needs recompute_old_logprobs); None = off
    lo.tis_cap = None
    lo.kl_coef = 0.0                # KL to the frozen reference policy; 0 = off (Dr. GRPO)
    lo.kl_estimator = "k3"          # k1 | k2 | k3
    # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    lo.aggregation = "seq-mean-token-sum-norm"
    lo.max_response_len = 128       # constant normalizer of seq-mean-token-sum-norm (Dr. GRPO)
    lo.lam_cap = 1.5                # Gagar lambda cap (>= 1)
    lo.mode = "sum_preserving"      # sum_preserving | downweight_only | binary
    # divide a group's outcome advantages by its rewards' std (+1e-6) first: verl's
    # norm_adv_by_std_in_grpo, for plain GRPO baselines (off: Dr. GRPO, SPEC rule 4)
    lo.norm_adv_by_std = False
    # learner recomputes pre-update log-probs as the ratio denominator
    lo.recompute_old_logprobs = False
    lo.policy_loss = "ppo"          # ppo | gspo | cispo (verl's vanilla / gspo / cispo)
    lo.entropy_coef = 0.0           # entropy bonus, aggregated like the loss; 0 = off
    # Rollout-mismatch correction (verl's rollout_corr names; need recompute_old_logprobs):
    # None | token | sequence | geometric IS weight
    lo.rollout_is = ml_collections.config_dict.placeholder(str)
    lo.rollout_is_threshold = 2.0   # its cap (truncated above)
    # None, or e.g. "seq_mean_k1" (geo-mask), "token_k1,seq_max_k3"
    lo.rollout_rs = ml_collections.config_dict.placeholder(str)
    # "lo_hi" or a number, one for all options or one each
    lo.rollout_rs_threshold = ml_collections.config_dict.placeholder(str)
    # IcePop band on the token ratio (both or neither)
    lo.icepop_low = ml_collections.config_dict.placeholder(float)
    lo.icepop_high = ml_collections.config_dict.placeholder(float)
    lo.routing_replay = "r3"        # r3: replay the feed's routed_experts | r2: the learner's own
    # Router aux/z loss weights come from model.router_aux_loss_coef / router_z_loss_coef.

    o = c.optim = ml_collections.ConfigDict()
    o.learning_rate = 1e-3          # peak learning rate (tiny model: large)
    o.warmup_steps = 2              # linear warmup, in optimizer updates (the first at lr / 2)
    o.schedule = "cosine"           # cosine | constant
    o.decay_steps = 100             # cosine length in optimizer updates (warmup included)
    o.min_lr_ratio = 0.1            # final lr / peak lr (cosine)
    o.b1 = 0.9
    o.b2 = 0.95
    o.eps = 1e-8
    o.weight_decay = 0.01           # on matrices only (never norms or biases)
    o.grad_clip_norm = 1.0          # global-norm clip; 0 = off

    f = c.feed = ml_collections.ConfigDict()   # see docs/feed.md
    # file or glob of *.jsonl / *.arrayrecord shards ("" = use spool_dir)
    f.path = "data/sample_feed.jsonl"
    f.spool_dir = ""                # live spool directory (atomic shard publish); "" = none
    f.spool_create = False          # create a missing spool_dir (else: a start-up error)
    f.spool_poll_s = 1.0            # seconds between listings of an idle spool
    f.spool_timeout_s = 0.0         # idle spool: end the feed after this long (0 = wait forever)
    f.spool_log_every_s = 30.0      # seconds between "waiting for the feed" lines
    # read a shard once its size+mtime are this old unchanged (0 = off)
    f.spool_settle_s = 2.0
    f.rows_per_batch = 16           # B, packed rows per global batch
    f.seq_len = 128                 # S, tokens per row
    f.tokens_per_batch = 0          # B x S: > 0 sizes the batch in tokens (rows_per_batch = 0)
    # Length buckets (docs/feed.md): row lengths, ascending; () = one row length (seq_len). With
    # buckets a step is micro-batches of bucket_rows rows of one bucket each, within
    # tokens_per_batch token slots; bucket_micro_batches caps each bucket (() = the budget).
    f.buckets = ()
    f.bucket_rows = 0
    f.bucket_micro_batches = ()
    f.max_trajectories = 40         # T, trajectory slots per batch
    f.groups_per_batch = 6          # G, mixed groups per batch
    f.max_staleness = 4             # drop groups whose policy_version lags the step by more
    # partial rollouts: oldest | newest | mean generated-token version
    f.staleness_from = "oldest"
    f.max_future_versions = 0       # quarantine groups ahead of the learner by more versions
    f.max_traj_tokens = 128         # longest trajectory (<= seq_len)
    # a trajectory longer than max_traj_tokens or marked `truncated` by its producer:
    # reject (its group) | drop (from the loss, kept in its group's statistics) | truncate
    f.overlong = "reject"
    f.overlong_buffer_len = 0       # DAPO soft overlong penalty: buffer tokens (0 = off) ...
    f.overlong_penalty_factor = 1.0  # ... and the penalty at max_traj_tokens (an adjustment)
    f.max_record_bytes = 4_000_000  # largest encoded record
    f.max_group_trajectories = 16   # most trajectories per group
    f.routing_replay = False        # always carry routed_experts_BxSxLxK (-1 where not recorded)
    f.filter_uniform = True         # drop all-pass / all-fail groups (DAPO's dynamic sampling)
    return c

"""Evaluation: perplexity (`perplexity.py`), the zero-shot tasks (`tasks.py`), weight and peak memory (`memory.py`),
speed (`speed.py`, through the engine of `engine.py`), and `nibble report` (`report.py`, its command line in
`report_command.py`) that puts them side by side.

The names the command line offers (the tasks, the speed models, the report's defaults) are here, apart from those
modules (which import torch), so that `nibble eval --help` and `nibble report --help` answer without torch's
seconds of imports."""

# the zero-shot tasks, in the order they are scored and reported (tasks.py: each one's data files and loader)
ALL_TASKS = ("piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "boolq", "openbookqa")

# the random-weight models speed.py builds and times, by their shapes (the published configs' sizes; model_type
# "llama" where none is named)
SPEED_MODELS = {
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rope_theta=10000.0),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    # q / k / v with biases; K = 3584 (28 groups of 128), 4 KV heads
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                       rope_theta=1000000.0),
    # per-head RMSNorms on q and k before RoPE (the engine runs them inside its RoPE + cache kernel)
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0),
}

# `nibble report`'s defaults (report.run_report's too)
DEFAULT_CONFIGS = ("bf16", "w4a16", "w4a4", "w4a4-hadamard")
DEFAULT_SPEED_MODELS = ("llama-2-7b",)
TASKS_BATCH_SIZE = 16  # requests a forward pass when scoring the tasks
SPEED_ROUNDS = 3  # rounds of alternating config order on each speed model (`report.measure_speed_models`)

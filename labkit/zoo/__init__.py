"""What is trained: model architectures and presets (`models`, `presets`, `moe`), datasets (`food11`), and
the Hugging Face cache they load from (`hub`, `fetch`, `cache`). Knows nothing about parallelism."""

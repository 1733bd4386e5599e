"""The policy and what builds it: the policy itself (HF text and Qwen2-VL checkpoints, ``policy``), chat rendering (``chat``),
the project's samplers (``sampling``, ``sampling_vl``), the embedded tiny models (``tiny``),
LoRA (``lora``), precision (``precision``) and in-place weight loading (``weights``)."""

"""Weight formats: nibble's canonical INT4 (`int4.py`), and the AutoAWQ (`awq.py`) and GPTQ (`gptq.py`) layouts it
converts to and from losslessly (`zero_points.py`: what those two share).

The formats' names are here, apart from those modules (which import torch), so that the command line offers them
(`nibble quantize --format`) without torch's seconds of imports."""

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")  # GPTQ's checkpoint_format: v1 stores zero point - 1, v2 the zero point
# save_quantized's names for the other tools' checkpoints: "gptq" is v1, or v2 where a zero point is 0 (`export_gptq`)
EXPORT_FORMATS = ("awq", *CHECKPOINT_FORMATS)
SAVE_FORMATS = ("nibble", *EXPORT_FORMATS)  # save_quantized's, and nibble quantize --format's

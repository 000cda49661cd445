"""Weight formats, one module each: :mod:`.fp8`, :mod:`.nvfp4` (ModelOpt), :mod:`.int4`,
:mod:`.int8` (weight-only packed CPU GEMMs), :mod:`.mxfp4` (gpt-oss's expert weights kept
packed); :mod:`.common` (the format record and lookup, shared helpers), :mod:`.packed` (what int4
and int8 share), :mod:`.calibrate` (activation ranges with ModelOpt)."""

#: ``--weights``: weight-only packed-integer linears on the CPU (:mod:`.packed`), or a gpt-oss
#: checkpoint's MXFP4 experts kept packed (:mod:`.mxfp4`)
INT_WEIGHT_FORMATS = ("int4", "int8")
WEIGHT_FORMATS = (*INT_WEIGHT_FORMATS, "mxfp4")
#: ``--drafter-weights``: ``auto`` (checkpoints/engine_dir.drafter_format), dense (``none``) or
#: a packed-integer format
DRAFTER_WEIGHTS = ("auto", "none", *INT_WEIGHT_FORMATS)

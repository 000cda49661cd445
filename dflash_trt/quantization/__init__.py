"""Weight formats, one module each: :mod:`.fp8`, :mod:`.nvfp4` (ModelOpt), :mod:`.int4`,
:mod:`.int8` (weight-only packed CPU GEMMs); :mod:`.common` (the format record and lookup,
shared helpers), :mod:`.packed` (what int4 and int8 share), :mod:`.calibrate` (activation
ranges with ModelOpt)."""

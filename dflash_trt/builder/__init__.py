"""Engine builder: validate, calibrate, quantize, shard, write (``dflash-trt build``)."""

"""gpupool's scheduler service: the pods of `schedulerName: gpupool` placed by the placement core."""

"""Chapter 08: splitting one model across processes (tensor and pipeline parallel) and running replicas."""

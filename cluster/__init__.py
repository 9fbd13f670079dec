"""Where specray meets a Ray cluster: placement of tensor-parallel groups, drafts and replicas."""

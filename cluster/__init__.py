"""Where specray meets a Ray cluster.

The manifests people deploy with live here beside this file: ``serve.yaml`` (the Serve
application), ``ray-cluster.yaml`` (Ray's cluster launcher: ``ray up``), ``rayservice.yaml``
(KubeRay's RayService, whose ``serveConfigV2`` is ``serve.yaml``'s application) and the
``Dockerfile`` of the image it runs; docs/cluster.md says how to deploy each. Placement of
tensor-parallel groups, drafts and replicas joins this package as code. The manifests import
nothing.
"""

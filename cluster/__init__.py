"""Where specray meets a Ray cluster.

``placement.py`` places a layout by role: a tensor-parallel target's ranks STRICT_PACK on one
node, drafts and other roles by the configured strategy, and a start-up error naming the
resource when the cluster cannot host it (the actors use it). The manifests people deploy with
live here beside this file: ``serve.yaml`` (the Serve application), ``ray-cluster.yaml`` (Ray's
cluster launcher: ``ray up``), ``rayservice.yaml`` (KubeRay's RayService, whose
``serveConfigV2`` is ``serve.yaml``'s application) and the ``Dockerfile`` of the image it runs;
docs/cluster.md says how to deploy each. The manifests import nothing.
"""

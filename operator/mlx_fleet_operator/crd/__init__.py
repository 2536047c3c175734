"""The ModelDeployment and Canary CRDs, generated from the operator's pydantic types.

One source per field: a field's type, bounds, default, description and CEL rules are declared
once, on the pydantic model the operator parses the field with (``spec.py``, ``canary_spec.py``,
the status models here); the CRD manifests in ``crds/`` and ``charts/mlx-fleet/crds/`` and the
field references ``docs/modeldeployment-api.md`` and ``docs/canary-api.md`` are generated from
them::

    python -m mlx_fleet_operator.crd            # rewrite the six files
    python -m mlx_fleet_operator.crd --check    # exit 1 naming each file that is out of date

* :mod:`.markers` — what a type declares beyond pydantic: CEL rules (:class:`~.markers.Rule`),
  extra OpenAPI keywords (:class:`~.markers.Keywords`), the wire schema of a field whose Python
  type differs from its JSON (:class:`~.markers.Wire`).
* :mod:`.schema` — a pydantic model → a structural OpenAPI v3 schema.
* :mod:`.resource` — a :class:`~.resource.Resource` (names, printer columns, subresources) → the
  CustomResourceDefinition manifest.
* :mod:`.modeldeployment`, :mod:`.canary` — the two resources: status models and identity.
* :mod:`.docs` — the field reference pages. :mod:`.generate` — the files and the CLI.

Nothing here is imported at package import, so ``spec.py`` can import :mod:`.markers` without a
cycle. Pure but for :mod:`.generate` (files).
"""

"""JSON values as annotations: what `json.loads` returns and `json.dumps` takes.

`JSON` is the recursive union of JSON's types; `JSONObject` is a parsed JSON object. A value
that crosses a JSON boundary (a request body, a constraint's schema, a cached record) is
annotated with them where its shape is not fixed; a fixed shape gets a TypedDict."""

from __future__ import annotations

from typing import TypeAlias

JSON: TypeAlias = dict[str, "JSON"] | list["JSON"] | str | int | float | bool | None
JSONObject: TypeAlias = dict[str, JSON]

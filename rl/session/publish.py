"""The agent's weight versions as the RL run sees them: the version last published, and the
tag a vLLM-served completion gets in its place (vLLM's responses name no weight version)."""

from __future__ import annotations


class Published:
    """A `WeightPublisher` that remembers the version it last published."""

    def __init__(self, inner):
        self.inner, self.version = inner, None

    async def publish(self, path: str, version: int):
        report = await self.inner.publish(path, version)
        self.version = version
        return report


class VersionTagged:
    """The agent client of a vLLM backend: tags each completion with the policy version
    `published` last published before the request was sent.

    vLLM's responses carry no weight version. For synchronous RL (`max_staleness: 0`) the tag
    is exact: no episode is admitted between a batch and the publish of the next version, so
    no request is in flight while weights change. For asynchronous RL a publish may land while
    a request decodes, so some of its tokens may come from the newer weights; the tag is then
    the older version, which can overstate a token's staleness but never understate it."""

    def __init__(self, client, published: Published):
        self.client, self.published = client, published

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    async def complete(self, *args, **kwargs):
        version = self.published.version
        out = await self.client.complete(*args, **kwargs)
        if out.weight_version is None and out.token_versions is None:
            out.weight_version = version
        return out

"""The route handlers that hand a command to a desk of the command service: tenants'
webhooks (workers.webhooks) and sealed secrets (workers.secrets)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from schemas import v1

if TYPE_CHECKING:
    from workers.routes import Context, Params
    from workers.secrets.desk import SecretDesk
    from workers.webhooks.desk import WebhookDesk


def webhook_desk(ctx: Context) -> WebhookDesk:
    from workers.errors import WebhooksUnavailable

    desk = ctx.webhooks  # the command service's, None elsewhere
    if desk is None:
        raise WebhooksUnavailable("webhooks are not served here")
    return desk


def webhook_add(ctx: Context, p: Params, cmd: Any) -> v1.Envelope:
    return v1.Envelope.success(result=webhook_desk(ctx).add(p["tenant"], cmd))


def webhook_list(ctx: Context, p: Params, cmd: Any) -> v1.Envelope:
    return v1.Envelope.success(result=webhook_desk(ctx).listing(p["tenant"]))


def webhook_delete(ctx: Context, p: Params, cmd: Any) -> v1.Envelope:
    return v1.Envelope.success(result=webhook_desk(ctx).delete(p["tenant"], cmd.endpoint_id))


def webhook_test(ctx: Context, p: Params, cmd: Any) -> v1.Envelope:
    return v1.Envelope.success(result=webhook_desk(ctx).test(p["tenant"], cmd.endpoint_id))


def webhook_deliveries(ctx: Context, p: Params, cmd: Any) -> v1.Envelope:
    return v1.Envelope.success(result=webhook_desk(ctx).deliveries(p["tenant"], cmd))


def secret_desk(ctx: Context) -> SecretDesk:
    from workers.errors import SecretsUnavailable

    desk = ctx.secrets  # the command service's, None elsewhere
    if desk is None:
        raise SecretsUnavailable("secrets are not served here")
    return desk


def with_secret_versions(ctx: Context, tenant: str, cmd: v1.CommitLease) -> v1.CommitLease:
    import msgspec

    job = cmd.job
    if not (job.secret_env or job.secret_files or job.secret_versions or job.registry_secret):
        return cmd
    return msgspec.structs.replace(cmd, job=secret_desk(ctx).resolve(tenant, job))


def secret_set(ctx: Context, p: Params, cmd: Any) -> v1.Envelope:
    return v1.Envelope.success(result=secret_desk(ctx).set(p["tenant"], cmd))


def secret_list(ctx: Context, p: Params, cmd: Any) -> v1.Envelope:
    return v1.Envelope.success(result=secret_desk(ctx).listing(p["tenant"]))


def secret_delete(ctx: Context, p: Params, cmd: Any) -> v1.Envelope:
    return v1.Envelope.success(result=secret_desk(ctx).delete(p["tenant"], cmd.name))


def secrets_reseal(ctx: Context, p: Params, cmd: Any) -> v1.Envelope:
    return v1.Envelope.success(result=secret_desk(ctx).reseal())


def node_secrets(ctx: Context, p: Params, cmd: Any) -> v1.Envelope:
    return v1.Envelope.success(result=secret_desk(ctx).fetch(p["node"], p["lease_id"], cmd))

"""The control plane's application: one store and the command services over it, composed.
Callers keep one object (`PoolApp`); each command is its service's method, handed out as is."""

from __future__ import annotations

import time
from collections.abc import Callable

from workers.application.accounts import AccountService
from workers.application.admin import AdminService
from workers.application.core import PLANE_APPLICATION_NAME, Store
from workers.application.gangs import GangService
from workers.application.leases import LeaseService
from workers.application.nodes import NodeService
from workers.application.workflows import WorkflowService


class PoolApp:
    """Every write the control plane makes goes through one of these methods: the store's
    surface (the log as the scheduler, dispatcher and projections read it) and each service's
    commands, bound here once so a call costs what a call of the service costs."""

    def __init__(self, env: dict[str, str] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store = Store(env, name=PLANE_APPLICATION_NAME)
        self.clock = clock
        self.gangs = GangService(store)
        self.accounts = AccountService(store, clock)
        self.workflows = WorkflowService(store)
        self.admin = AdminService(store, clock)
        self.leases = LeaseService(store, clock, gangs=self.gangs, accounts=self.accounts,
                                   workflows=self.workflows, admin=self.admin)
        self.nodes = NodeService(store, clock, gangs=self.gangs, accounts=self.accounts)
        self._bind_store(store)
        self._bind_commands()

    def _bind_store(self, store: Store) -> None:
        """The store's surface, as the readers of the log and the tests use it."""
        self.name = store.name
        self.env = store.env
        self.factory = store.factory
        self.recorder = store.recorder
        self.mapper = store.mapper
        self.events = store.events
        self.snapshots = store.snapshots
        self.snapshotting = store.snapshotting
        self.repository = store.repository
        self.find = store.find
        self.save = store.save
        self.save_nowait = store.save_nowait
        self.retrying = store.retrying
        self.close = store.close

    def _bind_commands(self) -> None:
        admin, leases, nodes = self.admin, self.leases, self.nodes
        # pools, prices, image policy, tenants, cohorts, reservations
        self.create_pool = admin.create_pool
        self.patch_pool = admin.patch_pool
        self.configure_pool = admin.configure_pool
        self.set_prices = admin.set_prices
        self.set_image_policy = admin.set_image_policy
        self.set_tenant = admin.set_tenant
        self.set_cohort = admin.set_cohort
        self.create_reservation = admin.create_reservation
        self.delete_reservation = admin.delete_reservation
        self.reservation_due = admin.reservation_due
        self.reservation_next_due = admin.reservation_next_due
        self.reservations = admin.reservations
        self.pool_settings = admin.pool_settings
        self.quotas_in_force = admin.quotas_in_force
        # credits and gangs
        self.grant = self.accounts.grant
        self.gang_members = self.gangs.members
        # a tenant's leases
        self.request_lease = leases.request_lease
        self.request_leases = leases.request_leases
        self.request_leases_async = leases.request_leases_async
        self.commit = leases.commit
        self.heartbeat = leases.heartbeat
        self.renew = leases.renew
        self.open_session = leases.open_session
        self.release = leases.release
        self.cancel = leases.cancel
        self.get = leases.get
        self.reconcile_due = leases.reconcile_due
        self.lease_next_due = leases.lease_next_due
        # nodes, their agents' reports and their timers
        self.register_node = nodes.register_node
        self.register_own_node = nodes.register_own_node
        self.enroll_node = nodes.enroll_node
        self.node_offline = nodes.node_offline
        self.node_state = nodes.node_state
        self.node_heartbeat = nodes.node_heartbeat
        self.node_heartbeat_async = nodes.node_heartbeat_async
        self.lease_on_node = nodes.lease_on_node
        self.confirm_stopped = nodes.confirm_stopped
        self.job_started = nodes.job_started
        self.job_ended = nodes.job_ended
        self.node_next_due = nodes.node_next_due
        self.node_due = nodes.node_due

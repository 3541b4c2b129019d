"""A bare Proton client's authentication, as the SDKs do it, for the tests that talk AMQP without an SDK (imported
as ``proton_cbs``: pytest puts this folder on ``sys.path``)."""

from __future__ import annotations

from typing import Any

from proton import Message

from spark_sb.emulator import NamespaceInfo, sas


def put_sas_token(conn: Any, ns: NamespaceInfo) -> None:
    """Authenticate the Proton ``BlockingConnection`` ``conn`` to ``ns``: a SAS token for the namespace put on
    ``$cbs`` (its two links stay open, as the SDKs keep them)."""
    audience = f"sb://localhost:{ns.amqp_port}"
    cbs = (conn.create_sender("$cbs"), conn.create_receiver("$cbs", credit=1))
    cbs[0].send(Message(reply_to="$cbs-client", body=sas.make_token(audience, ns.key_name, ns.key),
                        properties={"operation": "put-token", "type": "servicebus.windows.net:sastoken",
                                    "name": audience}))
    cbs[1].receive(timeout=10)
    cbs[1].accept()

"""``p2ptrain token``: the organiser's side of a closed run (``p2ptrain/net/dht/admission.py``).

    p2ptrain token --key organiser.id --show-id          # prints the organiser's ID (for [dht.admission])
    p2ptrain token --key organiser.id --run demo --peer QmVolunteer... --valid-days 30   # prints a join token

The key file is a libp2p RSA identity (created, mode 0600, if missing). Keep it private: whoever holds it
can admit anyone. The volunteer gives you their peer ID (printed in their agent's log, "joined run ... as
peer ...", or by ``--show-id`` on their own identity file) and passes the token with ``--join-token``.
"""

from __future__ import annotations

import click


@click.command(name="token")
@click.option("--key", "key_path", required=True, type=click.Path(dir_okay=False),
              help="The organiser's identity file (created if missing).")
@click.option("--show-id", is_flag=True, help="Print the peer ID of --key (the organiser's ID) and exit.")
@click.option("--run", "run_id", help="The run the token admits to.")
@click.option("--peer", "peer_id", help="The peer ID the token admits.")
@click.option("--valid-days", type=click.FloatRange(min=0, min_open=True), help="Expire after this many days.")
def command(key_path: str, show_id: bool, run_id: str | None, peer_id: str | None,
            valid_days: float | None) -> None:
    """Print the organiser's ID, or a join token admitting one peer to one run."""
    from p2ptrain.net.dht.admission import make_token
    from p2ptrain.net.identity import load_or_create_identity

    identity = load_or_create_identity(key_path)
    if show_id:
        click.echo(identity.peer_id)
        return
    if not run_id or not peer_id:
        raise click.UsageError("give --run and --peer (or --show-id)")
    valid_s = None if valid_days is None else valid_days * 86400.0
    click.echo(make_token(identity.private_key, run_id, peer_id, valid_s).to_text())

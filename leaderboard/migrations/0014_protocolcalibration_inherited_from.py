import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    """A protocol version derived for another engine version starts with a copy of its
    family's calibration (services.calibration.inherit), marked by `inherited_from`."""

    dependencies = [("leaderboard", "0013_run_queue_engine_workers")]

    operations = [
        migrations.AddField(
            model_name="protocolcalibration",
            name="inherited_from",
            field=models.ForeignKey(
                blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL,
                related_name="+", to="leaderboard.protocolcalibration",
                help_text="a copy of this calibration of another version of the protocol's "
                          "family (derived for another engine version), until the protocol "
                          "is calibrated from its own reruns"),
        ),
    ]

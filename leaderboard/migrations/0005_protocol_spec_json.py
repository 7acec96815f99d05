# Protocol.spec is the typed spec (worker.protocol.ProtocolSpec, built once per instance);
# the stored JSON is the field spec_json. Its column keeps the name "spec": the database,
# the stored rows and their hashes do not change.
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("leaderboard", "0004_protocol_v2_figures"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RenameField(model_name="protocol", old_name="spec",
                                       new_name="spec_json"),
                migrations.AlterField(
                    model_name="protocol", name="spec_json",
                    field=models.JSONField(db_column="spec", verbose_name="spec",
                                           help_text="the canonical measurement spec")),
            ],
            database_operations=[],
        ),
    ]

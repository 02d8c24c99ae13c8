"""All users; pick with locust's class arguments, e.g. `locust -f loadtests/locustfile.py SparkWebSocketUser`.

Against a real deployment:
    locust -f loadtests/locustfile.py --host http://spark.example.internal:9990 \\
        --headless -u 200 -r 20 -t 10m --csv reports/run --html reports/run.html
"""

from loadtests.http_streams import OpenAIChatUser, TGIStreamUser  # noqa: F401
from loadtests.spark_ws import SparkWebSocketUser  # noqa: F401

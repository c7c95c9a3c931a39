"""An agent framework end to end on a local `mlx-infer serve` (issue 48): the OpenAI Agents SDK runs an agent
whose function tool must be called (tool_choice "required"), through OpenAIChatCompletionsModel on an
AsyncOpenAI client pointed at 127.0.0.1, tracing off (nothing leaves the machine)."""

from typing import List

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI


def test_agent_calls_its_tool_with_validated_arguments(server):
    url, _ = server
    set_tracing_disabled(True)
    seen: List[tuple] = []

    @function_tool
    def get_weather(city: str, days: int) -> str:
        """The weather forecast of a city.

        Args:
            city: the city's name.
            days: how many days ahead.
        """
        seen.append((city, days))
        return f"Sunny in {city} for the next {days} days."

    model = OpenAIChatCompletionsModel(model="smollm2", openai_client=AsyncOpenAI(
        base_url=url + "/v1", api_key="none", max_retries=0, timeout=600))
    agent = Agent(name="forecaster", instructions="Answer weather questions with the get_weather tool.",
                  tools=[get_weather], model=model, tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", max_tokens=120, temperature=0))
    result = Runner.run_sync(agent, "What will the weather be in Lyon over the next three days?", max_turns=2)
    assert len(seen) >= 1
    city, days = seen[0]
    assert isinstance(city, str) and city and isinstance(days, int)  # the SDK validated them against the schema
    assert result.final_output == f"Sunny in {city} for the next {days} days."
